"""Benchmarks a user runs on any GPU machine (or a CPU, at tiny shapes), each printing its table and the command
that reproduces it: `acceptance` (which recipe drafts best), `training` (the training step and loop), `decoding`
(speculative decoding speed and what a served drafter accepts), `data` (tokenization, the S3 audit).
bench/README.md has one row per bench; bench/results/ holds the raw results behind docs/benchmarks.md.
Run from the repository root: `python -m bench.<package>.<bench> --help`."""
