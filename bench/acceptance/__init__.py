"""The acceptance bench (`python -m bench.acceptance prepare|run|report|curve`): drafters trained under each
recipe at an equal budget on the embedded SmolLM2 target, evaluated on held-out prompts.

`run.py` plans and runs the jobs; `variants.py` holds the recipes and the named suites; `data.py` and
`completions.py` the prompts, the target's greedy completions and the held-out baselines; `worker.py` a worker
process's state and the evaluator every drafter goes through; `ours.py` and `speculators.py` the two sides
(our Trainer, speculators 0.9's own models and loss); `report.py`, `scaling.py` and `curve.py` the tables and
plots. Nothing is imported here, so `curve` and `report` need no torch."""
