"""Evaluate a drafter checkpoint: real draft/verify rounds against the target on held-out prompts,
block and DDTree modes, compared token for token with the target's greedy decoding.

checkpoint (the train stage's `Checkpoint`) + prompts (by default the held-out split of the dataset it
was trained on; the training split only when asked for, labelled in-sample) -> evaluator ->
reports/evaluate/<run>/<flow run>/attempt-<n>/{report.json, acceptance.png, result.json} (manifests
whose inputs are the checkpoint files and the prompt shards) + Prefect table, markdown and image.
The result is an `EvaluationReport` that says which split it measured.

Run: `dflash run evaluate --params '{"checkpoint": "s3://dflash/reports/train/run-1/.../result.json"}'`
"""

from __future__ import annotations

from typing import Literal

from prefect import flow, get_run_logger
from prefect.runtime import flow_run
from pydantic import Field

from dflash_core.evaluate.generalization import generalization
from dflash_core.layout import ArtifactKind, artifact_key
from dflash_core.lineage import read_manifest
from dflash_core.settings import load_settings
from dflash_core.stage_results import MEASURED_ON, RESULT_FILE, Checkpoint, EvaluationReport, Split, TokenizedDataset
from dflash_core.strict import StrictModel
from flows.command_line import run_from_command_line
from tasks.artifacts import artifact_record, target_inputs
from tasks.evaluate import fetch_checkpoint, fetch_prompt_bytes, publish_evaluation, run_evaluation
from tasks.provenance import attempt_segments, flow_version
from tasks.results import resolve_checkpoint, resolve_result, store_result


class EvaluateParams(StrictModel):
    checkpoint: Checkpoint | str | None = Field(None, description=(
        "The drafter: the train stage's result (the pipeline passes it), or a step dir (model.safetensors + "
        "meta.json) as a local dir or S3 key/URI."))
    dataset: TokenizedDataset | str | None = Field(None, description=(
        "Where the prompts come from: a tokenize result (or its result.json URI); None: the dataset the checkpoint "
        "was trained on."))
    split: Split = Field("heldout", description=(
        "heldout: prompts never trained on (the default, what a user should read); train: in-sample, labelled so "
        "in the report (it overstates acceptance)."))
    prompts: str | None = Field(None, description="Or a prompt file instead of a dataset split: a tokenized .arrow "
                                                  "shard or a .jsonl file (input_ids or text per line), local or S3.")
    target: str | None = Field(None, description="`embedded`, `tiny:<family>` or a local model dir; None: the "
                                                 "checkpoint record's target.")
    target_seed: int | None = Field(None, description="Seed of a `tiny:<family>` random target (None: the checkpoint "
                                                      "record's).")
    run: str | None = Field(None, description="Report name: reports/evaluate/(run)/(flow run id)/attempt-(n)/, so a "
                                              "retry never overwrites a failed attempt's evidence; None: the run name.")
    num_prompts: int = Field(16, gt=0)
    max_prompt_tokens: int = Field(1024, gt=0, description="Keep the last N tokens of longer prompts.")
    max_new_tokens: int = Field(128, gt=0)
    modes: list[Literal["block", "tree"]] = Field(
        default_factory=lambda: ["block", "tree"], min_length=1,
        description="Decoding modes; DDTree (tree) is DFlash-only and skipped, with a warning, for DFlash 2 drafters.")
    tree_budget: int | None = Field(None, gt=0, description="DDTree node budget (None: 4 x (block_size - 1)).")
    eos_token_id: int | None = Field(None, description="Stop a response at this token (None: the target's).")
    device: str = Field("cpu", description="cpu or cuda[:n]; the target runs in bf16 on GPU, fp32 on CPU.")
    harness: Literal["auto", "eager", "graphs"] = Field("auto", description=(
        "How both sides of the comparison decode: eager (transformers, a growing cache) or graphs (fixed-shape "
        "caches replayed as CUDA graphs, block mode only); auto takes graphs on a GPU when every mode allows."))


def prompt_sources(settings, params: EvaluateParams, checkpoint: Checkpoint) -> tuple[str, list[str]]:
    """(split label, the prompt files or shards to read), by the rule in EvaluateParams."""
    if params.prompts is not None:
        if "split" in params.model_fields_set:
            raise ValueError("pass prompts (a file) or split (of a dataset), not both")
        return "file", [params.prompts]
    dataset = params.dataset if params.dataset is not None else checkpoint.dataset
    if dataset is None:
        raise ValueError("no prompts to evaluate on: the checkpoint names no dataset; pass dataset (a tokenize result) "
                         "or prompts (a file)")
    dataset = resolve_result(settings, dataset, TokenizedDataset)
    shards = dataset.split(params.split)
    if not shards:
        raise ValueError(f"dataset {dataset.dataset}/{dataset.run} has no {params.split} shards: import prompts with a "
                         f"holdout (generate's holdout.fraction or count), or pass prompts")
    return params.split, [s.uri for s in shards]


def _load_models(params: EvaluateParams, *, checkpoint_dir, settings, target_name: str, target_seed: int):
    import torch  # here, not at the top: the pipeline's process imports this module for the stage's form only

    from dflash_core.evaluate.inputs import load_drafter_checkpoint
    from dflash_core.target import target_heads
    from dflash_core.train.inputs import load_target_model

    device = torch.device(params.device)
    target = load_target_model(target_name, device=device, models_dir=settings.work_path("models"), seed=target_seed)
    drafter = load_drafter_checkpoint(checkpoint_dir, device=device).to(next(target.parameters()).dtype)
    drafter.attach_target(target_heads(target))
    return target, drafter


def _read_prompts(params: EvaluateParams, name: str, data: bytes, *, target, vocab_size: int,
                  num_prompts: int) -> list[list[int]]:
    from dflash_core.evaluate.inputs import check_prompts, prompts_from_jsonl, prompts_from_tokenized

    limits = {"num_prompts": num_prompts, "max_prompt_tokens": params.max_prompt_tokens}
    if name.endswith(".arrow"):
        prompts = prompts_from_tokenized(data, **limits)
    else:
        tokenizer = None
        path = getattr(target.config, "_name_or_path", "")
        if path:
            from transformers import AutoTokenizer

            try:
                tokenizer = AutoTokenizer.from_pretrained(path)
            except (OSError, ValueError):
                tokenizer = None
        prompts = prompts_from_jsonl(data, tokenizer=tokenizer, **limits)
    check_prompts(prompts, vocab_size=vocab_size)
    return prompts


def _modes_for(drafter, modes: list[str], *, logger) -> tuple[str, ...]:
    """`modes` less those the drafter cannot be decoded in (tree for DFlash 2), with a warning."""
    from dflash_core.evaluate import supported_modes

    kept = tuple(mode for mode in modes if mode in supported_modes(drafter))
    skipped = sorted(set(modes) - set(kept))
    if skipped:
        logger.warning("skipping modes %s: DDTree is DFlash-only, this is a DFlash 2 drafter", skipped)
    if not kept:
        raise ValueError(f"none of the modes {list(modes)} can evaluate this drafter; use {supported_modes(drafter)}")
    return kept


def _generalization(checkpoint: Checkpoint, summaries: list[dict]) -> dict | None:
    """The first mode's held-out tau against the training tau the checkpoint's final metrics hold (the
    last window's mean of the training batches' acceptance length)."""
    metrics = checkpoint.final_metrics
    train_tau = metrics.get("window_acceptance_length_empirical", metrics.get("acceptance_length_empirical"))
    if not summaries or train_tau is None:
        return None
    return generalization(train_tau=float(train_tau), heldout_tau=summaries[0]["tau"],
                          data_passes=metrics.get("data_passes"))


@flow(name="dflash-evaluate", log_prints=True, version=flow_version())
def evaluate(params: EvaluateParams) -> EvaluationReport:
    """checkpoint + prompts -> speculative decoding rounds -> report with lineage."""
    logger = get_run_logger()
    settings = load_settings()
    checkpoint = resolve_checkpoint(settings, params.checkpoint, target=params.target)
    split, sources = prompt_sources(settings, params, checkpoint)
    checkpoint_dir, checkpoint_refs = fetch_checkpoint(settings, checkpoint=checkpoint.uri,
                                                       cache_dir=settings.work_path("cache", "checkpoints"))
    target_name = params.target or checkpoint.target
    target_seed = params.target_seed if params.target_seed is not None else checkpoint.target_seed
    target, drafter = _load_models(params, checkpoint_dir=checkpoint_dir, settings=settings, target_name=target_name,
                                   target_seed=target_seed)
    text_config = getattr(target.config, "text_config", None) or target.config
    prompts, prompt_refs = [], []
    for source in sources:  # shard by shard until num_prompts
        data, ref = fetch_prompt_bytes(settings, prompts=source)
        prompts += _read_prompts(params, source, data, target=target, vocab_size=text_config.vocab_size,
                                 num_prompts=params.num_prompts - len(prompts))
        prompt_refs.append(ref)
        if len(prompts) >= params.num_prompts:
            break
    eos = params.eos_token_id if params.eos_token_id is not None else getattr(text_config, "eos_token_id", None)
    eos = eos[0] if isinstance(eos, list) else eos
    modes = _modes_for(drafter, params.modes, logger=logger)
    logger.info("evaluating %s on %d prompts of %s, modes %s", checkpoint.uri, len(prompts), MEASURED_ON[split], modes)
    report = run_evaluation(target=target, drafter=drafter, prompts=prompts, modes=modes,
                            max_new_tokens=params.max_new_tokens, eos_token_id=eos, tree_budget=params.tree_budget,
                            harness=params.harness)
    run = params.run or checkpoint.run_name
    key_prefix = artifact_key(settings.s3_prefixes, ArtifactKind.REPORT, "evaluate", run, *attempt_segments())
    config = {**params.model_dump(mode="json", exclude={"checkpoint", "dataset"}), "checkpoint": checkpoint.uri,
              "split": split, "target": target_name, "target_seed": target_seed,
              "drafter_config": drafter.config.to_dict(), "num_prompts_used": len(prompts)}
    # What was measured: the drafter's files, the prompts, and the target it drafted for (its files by sha256).
    inputs = [*checkpoint_refs, *prompt_refs, *target_inputs(settings, target_name, seed=target_seed)]
    manifest = publish_evaluation(settings, report=report, key_prefix=key_prefix, inputs=inputs, config=config,
                                  work_dir=settings.work_path("evaluate", run), measured_on=MEASURED_ON[split])
    logger.info("measured on %s\n%s", MEASURED_ON[split], report["table"])
    from dflash_core.storage import ObjectStore

    plot = read_manifest(ObjectStore.from_settings(settings), f"{key_prefix}/acceptance.png")
    fit = _generalization(checkpoint, report["summaries"]) if split == "heldout" else None
    if fit is not None and fit["overfit"]:
        logger.warning("overfit: %s", fit["advice"])
    result = EvaluationReport(
        report=manifest.uri, split=split, prompts=[ref.uri for ref in prompt_refs], checkpoint=checkpoint.uri,
        summaries=[{k: v for k, v in s.items() if k != "responses"} for s in report["summaries"]], generalization=fit,
        flow_run=str(flow_run.id or ""), artifacts=[artifact_record(manifest), artifact_record(plot)])
    return store_result(settings, result, key=f"{key_prefix}/{RESULT_FILE}", inputs=inputs)


if __name__ == "__main__":
    run_from_command_line(evaluate, EvaluateParams)
