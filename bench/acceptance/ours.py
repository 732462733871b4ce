"""The acceptance bench's side of our library: a row trained through the real Trainer on the worker's
corpus, checked to carry the row's levers, then evaluated by the shared evaluator."""

from __future__ import annotations

import json
import shutil
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from .worker import (WORKER, corpus_for_worker, evaluate_drafter, steady_rate, sync_device, train_config,
                     training_attention)

if TYPE_CHECKING:
    from .variants import Job, Variant


def run_ours(job: Job, variant: Variant) -> dict:
    run_dir = Path(WORKER["work"]) / "runs"
    config = train_config(job, variant, run_dir)
    if not WORKER.get("resume"):
        shutil.rmtree(config.run_dir, ignore_errors=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from dflash_core.train.assemble import build_trainer

        corpus = corpus_for_worker(getattr(job, "data_multiplier", None))
        trainer = build_trainer(config, models_dir=Path(WORKER["models_dir"]), corpus=corpus)
    check_recipe_applied(config, trainer.drafter_config, trainer.drafter.loss)
    resumed_from = trainer.step if WORKER.get("resume") and trainer.resume() else 0  # exact: sampler, RNG, optimizer
    # The run's figures, kept with its checkpoint until the row is written: a run stopped in evaluation resumes
    # at the finished checkpoint and reports these instead of its own empty training.
    trained_path = config.run_dir / "trained.json"
    trained = json.loads(trained_path.read_text()) if resumed_from and trained_path.is_file() else None
    logged: list[tuple[int, float]] = []  # (step, time) of each record: steady-state steps/s between them
    host = HostTime()
    sync_device()
    start = time.perf_counter()
    result = trainer.run(on_log=lambda record: logged.append((record["step"], time.perf_counter())),
                         on_step=lambda *, step, metrics, timing: host.add(timing, steady=bool(logged)
                                                                           and step > logged[0][0]))
    sync_device()
    train_s = time.perf_counter() - start
    trainer.close()
    if trained is None:
        window = json.loads(result.metrics_path.read_text().splitlines()[-1])
        window = window.get("window") or window
        trained = {"train_s": train_s, "steps_per_s": steady_rate(logged, job.steps - resumed_from, train_s),
                   "resumed_from_step": resumed_from, "train_loss": window["loss"],
                   "train_attention": training_attention(),
                   "train_tau": window["acceptance_length_empirical"], **host.summary()}
        trained_path.write_text(json.dumps(trained))
    drafter_config = trainer.drafter_config
    drafter = trainer.drafter
    if WORKER.get("save_drafters"):
        from dflash_core.export import export_drafter

        export_drafter(drafter, target_config=trainer.target.config, out_dir=Path(WORKER["save_drafters"]) /
                       config.run_name, verifier_name_or_path=WORKER["model_dir"], dtype=torch.bfloat16)
    del trainer
    row = {**trained, "mask_token_id": drafter_config.mask_token_id,
           "mask_rule": "ours",
           "target_layer_ids": drafter_config.target_layer_ids, **evaluate_drafter(drafter)}
    shutil.rmtree(config.run_dir, ignore_errors=True)
    return row


class HostTime:
    """Where a job's main thread spends a step once the first record is logged (compilation over): packing
    and copying batches, queuing the step's work (waiting too, when the GPU's launch queue is full), and the
    log steps' wait on the device; with the graphs dynamo compiled in this process. A job whose steps/s is far
    under its host's pace waits on a GPU it shares; one whose dispatch fills the step is host-bound."""

    def __init__(self) -> None:
        from torch._dynamo.utils import counters

        self.steady: list = []  # the Trainer's StepTiming of each steady step
        self.graphs_before = counters["stats"]["unique_graphs"]  # a worker process runs several jobs

    def add(self, timing, *, steady: bool) -> None:
        if steady:
            self.steady.append(timing)

    def summary(self) -> dict:
        from torch._dynamo.utils import counters

        from dflash_core.train.strategies import StepTiming

        per_step = {f"host_{name}_ms": ms for name, ms in StepTiming.mean_ms(self.steady).items()}
        return {**per_step, "compiled_graphs": int(counters["stats"]["unique_graphs"] - self.graphs_before)}


def check_recipe_applied(config, drafter_config, loss) -> None:
    """The drafter the Trainer built trains with the run's loss spec (training-only settings) and taps
    the run's layers: a variant whose lever the trainer dropped would silently measure the default."""
    wanted = config.drafter.loss_spec()
    if loss != wanted:
        raise RuntimeError(f"the Trainer built a drafter training with {loss}, the run asks for {wanted}: the "
                           "assembly must build the drafter with DrafterSettings.loss_spec()")
    taps, depth = config.drafter.target_layer_ids, drafter_config.target_num_layers
    if taps is None and depth:  # a tap count (num_tapped_layers, or the default's) spread over the target
        taps = config.drafter.tapped_layer_ids(num_target_layers=depth)
    if taps is not None and list(drafter_config.target_layer_ids) != list(taps):
        raise RuntimeError(f"the Trainer built a drafter tapping {drafter_config.target_layer_ids}, the run asks "
                           f"for {taps}")
