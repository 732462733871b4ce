"""The acceptance bench's worker: the state one worker process holds (its context, the evaluation
target, the training corpus), the evaluator every drafter goes through, and the TrainConfig of a job.
Both sides of the ablation (our Trainer in ours.py, speculators in speculators.py)
read it, so a job's data, budget and evaluation are the same whichever drafter it trains."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from .completions import read_completions, training_corpus
from .variants import FULL

if TYPE_CHECKING:
    from .variants import Job, Variant

WORKER: dict[str, Any] = {}


def worker_init(context: dict, counter=None) -> None:
    """A worker's state. `counter` (a shared multiprocessing Value): each worker takes the next of
    `context["devices"]` in turn, so workers spread over the GPUs; without it, the first device."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    torch.set_num_threads(context["threads"])
    WORKER.clear()
    WORKER.update(context)
    index = 0
    if counter is not None:
        with counter.get_lock():
            index, counter.value = counter.value, counter.value + 1
    WORKER["device"] = context["devices"][index % len(context["devices"])]
    device = torch.device(WORKER["device"])
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)  # kernels compiled and launched without a device go to this GPU


def eval_target():
    if "eval_target" not in WORKER:
        from dflash_core.target import load_target

        WORKER["eval_target"] = load_target(str(WORKER["model_dir"]), device=WORKER["device"],
                                             dtype=getattr(torch, WORKER["eval_dtype"]))
    return WORKER["eval_target"]


def corpus_for_worker(data_multiplier: int | None = None):
    """The training corpus: every completion, or with a data multiplier m its first m x train_prompts
    (nested: a bigger set holds the smaller ones)."""
    corpora = WORKER.setdefault("corpora", {})
    if data_multiplier not in corpora:
        if "records" not in WORKER:
            WORKER["records"] = read_completions(Path(WORKER["data_path"]))
        records = WORKER["records"]
        if data_multiplier is not None:
            records = records[: data_multiplier * WORKER["shape"]["train_prompts"]]
        corpora[data_multiplier] = training_corpus(records)
    return corpora[data_multiplier]


def evaluate_drafter(drafter) -> dict:
    """Our evaluator's block mode on every held-out prompt; per-response tau averaged over responses. The
    harness (`eval_harness`, auto: CUDA graphs on a GPU, as the evaluate stage) changes the wall time only:
    both decode the same tokens (tests/unit/test_evaluate_graphed.py)."""
    from dflash_core.evaluate import SpeculativeDecoder, summarize
    from dflash_core.evaluate.graphed import GraphedDecoder
    from dflash_core.evaluate.report import ResponseResult
    from dflash_core.evaluate.run import pick_harness
    from dflash_core.target import target_heads

    began = time.perf_counter()
    target = eval_target()
    if getattr(drafter, "_layers_compiled", False):  # trained with --train-compile
        drafter.uncompile_layers()
    drafter = drafter.to(dtype=next(target.parameters()).dtype)
    drafter.attach_target(target_heads(target))
    harness = pick_harness(WORKER.get("eval_harness", "auto"), target=target, modes=("block",))
    if harness == "graphs":
        capacity = (max(len(item["prompt"]) for item in WORKER["eval_set"]) + WORKER["eval_new_tokens"]
                    + 2 * drafter.config.block_size + 16)
        decoder = GraphedDecoder(target=target, drafter=drafter, capacity=capacity)
    else:
        decoder = SpeculativeDecoder(target=target, drafter=drafter, mode="block")
    results = []
    for index, item in enumerate(WORKER["eval_set"]):
        decoded = decoder.generate(item["prompt"], max_new_tokens=WORKER["eval_new_tokens"],
                                   eos_token_id=WORKER["eos_id"])
        results.append(ResponseResult(prompt_index=index, prompt_tokens=len(item["prompt"]), decoded=decoded,
                                      baseline_wall_s=item["baseline_wall_s"],
                                      matches_target=decoded.tokens == item["baseline"]))
    summary = summarize(results, block_size=drafter.config.block_size, mode="block")
    by_source = {}
    for source in ("sharegpt", "own"):
        taus = [r.decoded.tau for r, item in zip(results, WORKER["eval_set"])
                if item["id"].startswith(source) and r.decoded.accepted]
        by_source[source] = sum(taus) / len(taus) if taus else None
    return {"tau": summary["tau"], "acceptance_per_position": summary["acceptance_per_position"],
            "all_match_target": summary["all_match_target"], "tau_by_source": by_source,
            "num_rounds": summary["num_rounds"], "eval_s": time.perf_counter() - began, "eval_harness": harness}


def train_config(job: Job, variant: Variant, run_dir: Path):
    from dflash_core.train.config import TrainConfig

    shape = WORKER["shape"]
    drafter = {"num_layers": shape["num_layers"], "block_size": shape["block_size"],
               "num_anchors": shape["num_anchors"], **variant.drafter}
    if "num_anchors" in variant.drafter:  # a variant's anchors are per 2,048-token row: its density at this shape
        drafter["num_anchors"] = max(1, variant.drafter["num_anchors"] * shape["token_budget"] // FULL.token_budget)
    return TrainConfig(run_name=job.run_name, target="embedded",
                       data=["<in-memory>"], output_dir=run_dir, token_budget=shape["token_budget"],
                       max_steps=job.steps, seed=job.seed, checkpoint_every=checkpoint_every(job), keep_last=1,
                       upload_checkpoints=False, log_every=max(1, min(25, job.steps // 4)),
                       validate_capture_batches=0, attention_backend=training_attention(), drafter=drafter,
                       compile=bool(WORKER.get("train_compile")),
                       compile_mode=WORKER.get("train_compile") or "default",
                       optim=variant.optim, target_device=WORKER["device"], **variant.train)



def training_attention() -> str:
    """The rows' drafter attention in training, `--attention` resolved as the drafter resolves it (auto: flex on a
    GPU, the dense path on the CPU)."""
    from dflash_core.model.masks import resolve_attention_backend

    return resolve_attention_backend(WORKER.get("attention", "auto"), cuda=WORKER["device"].startswith("cuda"))


def checkpoint_every(job: Job) -> int:
    """Steps between a job's checkpoints: `--checkpoint-every` (so a job stopped midway resumes with `--resume`),
    else only at its end."""
    every = WORKER.get("checkpoint_every")
    return min(every, job.steps) if every else job.steps


def steady_rate(marks: list[tuple[int, float]], steps: int, total_s: float) -> float:
    """Steps per second after the first logged step (so compilation and warmup stay out)."""
    if len(marks) >= 2 and marks[-1][1] > marks[0][1]:
        return (marks[-1][0] - marks[0][0]) / (marks[-1][1] - marks[0][1])
    return steps / total_s


def sync_device() -> None:
    if torch.cuda.is_available() and WORKER["device"].startswith("cuda"):
        torch.cuda.synchronize()
