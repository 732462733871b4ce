"""Evaluate a drafter checkpoint: real draft/verify rounds against the target on held-out prompts,
block and DDTree modes, compared token for token with the target's greedy decoding.

checkpoint + prompts -> evaluator -> reports/evaluate/<run>/<flow run>/attempt-<n>/{report.json, acceptance.png} (manifests
whose inputs are the checkpoint files and the prompt file) + Prefect table, markdown and image.

Run: `.venv/bin/python -m flows.evaluate --params '{"checkpoint": "checkpoints/run-1/step-000100", "prompts": "held-out.jsonl"}'`
"""

from __future__ import annotations

from typing import Literal

import torch
from prefect import flow, get_run_logger
from pydantic import BaseModel, Field

from dflash_core.layout import ArtifactKind, artifact_key
from dflash_core.lineage import read_manifest
from dflash_core.settings import load_settings
from flows.command_line import run_from_command_line
from tasks.artifacts import artifact_record
from tasks.evaluate import fetch_checkpoint, fetch_prompt_bytes, publish_evaluation, run_evaluation
from tasks.provenance import attempt_segments, flow_version


class EvaluateParams(BaseModel):
    checkpoint: str = Field(description="Drafter checkpoint: a local dir or an S3 key of a step dir "
                                        "(model.safetensors + meta.json).")
    prompts: str = Field(description="Held-out prompts: a tokenized .arrow shard or a .jsonl file "
                                     "(input_ids or text per line), local path or S3 key.")
    target: str = Field("embedded", description="`embedded`, `tiny:<family>` or a local model dir.")
    target_seed: int = Field(0, description="Seed of a `tiny:<family>` random target (must match training).")
    run: str = Field("eval-1", description="Report name: reports/evaluate/(run)/(flow run id)/attempt-(n)/, so a "
                                           "retry never overwrites a failed attempt's evidence.")
    num_prompts: int = Field(16, gt=0)
    max_prompt_tokens: int = Field(1024, gt=0, description="Keep the last N tokens of longer prompts.")
    max_new_tokens: int = Field(128, gt=0)
    modes: list[Literal["block", "tree"]] = Field(
        default_factory=lambda: ["block", "tree"], min_length=1,
        description="Decoding modes; DDTree (tree) is DFlash-only and skipped, with a warning, for DFlash 2 drafters.")
    tree_budget: int | None = Field(None, gt=0, description="DDTree node budget (None: 4 x (block_size - 1)).")
    eos_token_id: int | None = Field(None, description="Stop a response at this token (None: the target's).")
    device: str = Field("cpu", description="cpu or cuda[:n]; the target runs in bf16 on GPU, fp32 on CPU.")


def _load_models(params: EvaluateParams, *, checkpoint_dir, settings):
    from dflash_core.evaluate.inputs import load_drafter_checkpoint
    from dflash_core.target import target_heads
    from dflash_core.train.inputs import load_target_model

    device = torch.device(params.device)
    target = load_target_model(params.target, device=device, models_dir=settings.work_path("models"),
                               seed=params.target_seed)
    drafter = load_drafter_checkpoint(checkpoint_dir, device=device).to(next(target.parameters()).dtype)
    drafter.attach_target(target_heads(target))
    return target, drafter


def _read_prompts(params: EvaluateParams, data: bytes, *, target, vocab_size: int) -> list[list[int]]:
    from dflash_core.evaluate.inputs import check_prompts, prompts_from_jsonl, prompts_from_tokenized

    limits = {"num_prompts": params.num_prompts, "max_prompt_tokens": params.max_prompt_tokens}
    if params.prompts.endswith(".arrow"):
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


@flow(name="dflash-evaluate", log_prints=True, version=flow_version())
def evaluate(params: EvaluateParams) -> dict:
    """checkpoint + prompts -> speculative decoding rounds -> report with lineage."""
    logger = get_run_logger()
    settings = load_settings()
    checkpoint_dir, checkpoint_refs = fetch_checkpoint(settings, checkpoint=params.checkpoint,
                                                       cache_dir=settings.work_path("cache", "checkpoints"))
    prompt_bytes, prompt_ref = fetch_prompt_bytes(settings, prompts=params.prompts)
    target, drafter = _load_models(params, checkpoint_dir=checkpoint_dir, settings=settings)
    text_config = getattr(target.config, "text_config", None) or target.config
    prompts = _read_prompts(params, prompt_bytes, target=target, vocab_size=text_config.vocab_size)
    eos = params.eos_token_id if params.eos_token_id is not None else getattr(text_config, "eos_token_id", None)
    eos = eos[0] if isinstance(eos, list) else eos
    modes = _modes_for(drafter, params.modes, logger=logger)
    logger.info("evaluating %s on %d prompts, modes %s", params.checkpoint, len(prompts), modes)
    report = run_evaluation(target=target, drafter=drafter, prompts=prompts, modes=modes,
                            max_new_tokens=params.max_new_tokens, eos_token_id=eos, tree_budget=params.tree_budget)
    key_prefix = artifact_key(settings.s3_prefixes, ArtifactKind.REPORT, "evaluate", params.run, *attempt_segments())
    config = {**params.model_dump(mode="json"), "drafter_config": drafter.config.to_dict(), "num_prompts_used": len(prompts)}
    manifest = publish_evaluation(settings, report=report, key_prefix=key_prefix,
                                  inputs=[*checkpoint_refs, prompt_ref], config=config,
                                  work_dir=settings.work_path("evaluate", params.run))
    logger.info("\n%s", report["table"])
    from dflash_core.storage import ObjectStore

    plot = read_manifest(ObjectStore.from_settings(settings), f"{key_prefix}/acceptance.png")
    return {"report": manifest.uri, "artifacts": [artifact_record(manifest), artifact_record(plot)],
            "summaries": [{k: v for k, v in s.items() if k != "responses"} for s in report["summaries"]]}


if __name__ == "__main__":
    run_from_command_line(evaluate, EvaluateParams)
