"""The drafter served by vLLM, measured in the engine: export (the export stage's result) + its target + the
prompts the evaluate stage measured -> a target-only vLLM, then a vLLM that drafts with the export
(`--speculative-config {method, model, num_speculative_tokens: block_size - 1}`), the same prompts at
temperature 0 at each concurrency -> reports/served/<run>/<flow run>/attempt-<n>/{report.json, result.json}
+ a Prefect table and summary. The engine's acceptance (its own spec-decode counters) stands beside our
evaluator's tau on the same prompts, and every drafted output is compared with the target-only one.

An export the engine's version cannot serve (DFlash 2 on vLLM 0.26) is refused by name before any server
starts.

Run: `dflash run served --params '{"export": ".../reports/export/RUN/.../result.json",
"evaluation": ".../reports/evaluate/RUN/.../result.json", "python": "/tmp/dflash-node/vllm-venv/bin/python"}'`
"""

from __future__ import annotations

import json
import sys
from typing import Literal

from prefect import flow, get_run_logger
from prefect.runtime import flow_run
from pydantic import Field

from dflash_core.evaluate.served import compare_served, markdown_table
from dflash_core.layout import ArtifactKind, artifact_key
from dflash_core.storage.local_paths import path_inside
from dflash_core.settings import Settings, load_settings
from dflash_core.stage_results import RESULT_FILE, EvaluationReport, ExportResult, ServedReport
from dflash_core.strict import StrictModel
from flows.command_line import run_from_command_line
from tasks.artifacts import artifact_record
from tasks.evaluate import fetch_prompt_bytes
from tasks.provenance import attempt_segments, flow_version
from tasks.results import resolve_checkpoint, resolve_result, store_result
from tasks.served import engine_version, fetch_export, publish_served, serve_and_measure


# How far the engine's tau may sit from our evaluator's on the same prompts before the stage says so: batching in
# the engine and bf16 near-ties move a few rounds, not a tenth of them.
TAU_AGREEMENT = 0.05


class ServedParams(StrictModel):
    export: ExportResult | str | None = Field(None, description=(
        "The drafter: the export stage's result (the pipeline passes it) or its result.json URI."))
    evaluation: EvaluationReport | str | None = Field(None, description=(
        "The evaluate stage's result (the pipeline passes it): its prompts, prompt length and tokens are served, "
        "and its tau is put beside the engine's."))
    format: Literal["speculators", "native"] = Field("speculators", description=(
        "Which export vLLM loads: speculators (speculators_model_type dflash) or native (DFlashDraftModel)."))
    target: str | None = Field(None, description=(
        "The target's model dir (`@node` on a provisioned node); None: the checkpoint's target (`embedded`: the "
        "converted SmolLM2)."))
    python: str | None = Field(None, description=(
        "The interpreter of vLLM's venv (the node's WORK_DIR/vllm-venv/bin/python, infra/node-install.sh --vllm); "
        "None: the stage's own."))
    concurrency: list[int] = Field(default_factory=lambda: [1, 8, 32], min_length=1, description=(
        "Requests in flight; each is one pass over every prompt, on both servers."))
    num_prompts: int | None = Field(None, gt=0, description="None: as many as the evaluation measured.")
    max_new_tokens: int | None = Field(None, gt=0, description="None: the evaluation's.")
    max_prompt_tokens: int = Field(1024, gt=0, description="Keep the last N tokens of longer prompts (with no "
                                                          "evaluation; otherwise the evaluation's).")
    dtype: str = Field("bfloat16", description="The target's and drafter's dtype in the engine (our evaluator's on GPU).")
    gpu_memory_utilization: float = Field(0.5, gt=0, le=1)
    max_model_len: int = Field(4096, gt=0)
    device: str | None = Field("0", description="CUDA_VISIBLE_DEVICES of the servers.")
    base_port: int = Field(8300, gt=0, lt=65536)
    ready_timeout_s: float = Field(900.0, gt=0)
    run: str | None = Field(None, description="Report name: reports/served/(run)/...; None: the export's run.")


def _target_dir(settings: Settings, params: ServedParams, export: ExportResult) -> str:
    target = params.target or resolve_checkpoint(settings, export.checkpoint).target
    if target == "embedded":
        from dflash_core.embedded import embedded_model_dir

        return str(embedded_model_dir(settings.work_path("models")))
    if target.startswith(("tiny:", "random:")):
        raise ValueError(f"target {target!r} is built in code; vLLM serves a model directory: pass target")
    return target


def _prompts(settings: Settings, params: ServedParams, evaluation: EvaluationReport | None, *, tokenizer_dir: str):
    """(prompt token ids, their input refs, max_new_tokens, the evaluation's block-mode tau over all its rounds)."""
    from dflash_core.evaluate.inputs import prompts_from_jsonl, prompts_from_tokenized

    if evaluation is None:
        raise ValueError("no prompts to serve: pass evaluation (the evaluate stage's result), whose prompts, lengths "
                         "and tau the served figures stand beside")
    data, _ = fetch_prompt_bytes(settings, prompts=evaluation.report)
    config = json.loads(data)["config"]
    wanted = params.num_prompts or config.get("num_prompts_used") or config["num_prompts"]
    limits = {"max_prompt_tokens": config.get("max_prompt_tokens", params.max_prompt_tokens)}
    prompts, refs = [], []
    for source in evaluation.prompts:
        data, ref = fetch_prompt_bytes(settings, prompts=source)
        if source.endswith(".arrow"):
            prompts += prompts_from_tokenized(data, num_prompts=wanted - len(prompts), **limits)
        else:
            from transformers import AutoTokenizer

            prompts += prompts_from_jsonl(data, tokenizer=AutoTokenizer.from_pretrained(tokenizer_dir),
                                          num_prompts=wanted - len(prompts), **limits)
        refs.append(ref)
        if len(prompts) >= wanted:
            break
    block = next((s for s in evaluation.summaries if s.get("mode") == "block"), {})
    tau = block.get("tau_pooled", block.get("tau"))  # pooled over rounds, as the engine's counters are
    return prompts, refs, params.max_new_tokens or config["max_new_tokens"], tau


@flow(name="dflash-served", log_prints=True, version=flow_version())
def served(params: ServedParams) -> ServedReport:
    """export + prompts -> target-only and drafting vLLM servers -> the served table, beside our evaluator's tau."""
    from dflash_core.export.engines import check_servable, speculative_config  # imports torch: not for the form

    logger = get_run_logger()
    settings = load_settings()
    if params.export is None:
        raise ValueError("no export given: pass the export stage's result or its result.json URI")
    export = resolve_result(settings, params.export, ExportResult)
    if params.format not in export.exports:
        raise ValueError(f"the export has no {params.format} format (it has {sorted(export.exports)}): choose one")
    evaluation = resolve_result(settings, params.evaluation, EvaluationReport) if params.evaluation else None
    run = params.run or export.exports[params.format].rstrip("/").split("/")[-2]
    export_dir, export_refs = fetch_export(settings, prefix_uri=export.exports[params.format],
                                           dest=path_inside(settings.work_path("served"), f"{run}/{params.format}"))
    draft_config = json.loads((export_dir / "config.json").read_text())
    python = params.python
    version = engine_version(python or sys.executable)
    check_servable(draft_config, engine="vllm", version=version)
    target = _target_dir(settings, params, export)
    prompts, prompt_refs, max_new_tokens, evaluator_tau = _prompts(settings, params, evaluation, tokenizer_dir=target)
    common = {"model": target, "python": python, "dtype": params.dtype, "max_model_len": params.max_model_len,
              "gpu_memory_utilization": params.gpu_memory_utilization, "ready_timeout_s": params.ready_timeout_s,
              "env": {"VLLM_USE_FLASHINFER_SAMPLER": "0"}}
    spec = speculative_config(export_dir, engine="vllm", version=version)
    run_dir = path_inside(settings.work_path("served"), f"{run}/servers")
    measure = {"run_dir": run_dir, "port": params.base_port, "device": params.device, "prompts": prompts,
               "max_new_tokens": max_new_tokens, "concurrencies": list(params.concurrency)}
    logger.info("serving %d prompts x %d tokens with vLLM %s: target-only, then drafting with %s", len(prompts),
                max_new_tokens, version, spec)
    target_only = serve_and_measure(VllmProfile(**common), name="target-only", **measure)
    drafted = serve_and_measure(VllmProfile(**common, speculative_config=spec), name="drafter", **measure)
    table = compare_served(target_only, drafted)
    if not table["all_outputs_equal"]:
        logger.warning("some drafted outputs differ from the target-only server's: %s",
                       [(r["concurrency"], r["outputs_equal_target"], r["prompts"]) for r in table["rows"]])
    logger.info("\n%s", markdown_table(table, evaluator_tau=evaluator_tau))
    if evaluator_tau and table["tau"] and abs(table["tau"] - evaluator_tau) > TAU_AGREEMENT * evaluator_tau:
        logger.warning("the engine's tau %.3f and our evaluator's %.3f differ by more than %.0f%% on the same prompts: "
                       "the engine does not draft what the drafter was trained and evaluated to draft (compare the "
                       "export's config with what the engine reads: docs/drafter.md)", table["tau"], evaluator_tau,
                       100 * TAU_AGREEMENT)
    key_prefix = artifact_key(settings.s3_prefixes, ArtifactKind.REPORT, "served", run, *attempt_segments())
    inputs = [*export_refs, *prompt_refs]
    config = {**params.model_dump(mode="json", exclude={"export", "evaluation"}), "engine": f"vllm {version}",
              "export": export.exports[params.format], "speculative_config": {**spec, "model": params.format},
              "num_prompts_used": len(prompts), "max_new_tokens": max_new_tokens, "target": target}
    manifest = publish_served(settings, served=table, key_prefix=key_prefix, inputs=inputs, config=config,
                              evaluator_tau=evaluator_tau)
    result = ServedReport(report=manifest.uri, export=export.exports[params.format], engine=f"vllm {version}",
                          prompts=[ref.uri for ref in prompt_refs], rows=table["rows"], tau=table["tau"],
                          evaluator_tau=evaluator_tau, all_outputs_equal=table["all_outputs_equal"],
                          flow_run=str(flow_run.id or ""), artifacts=[artifact_record(manifest)])
    return store_result(settings, result, key=f"{key_prefix}/{RESULT_FILE}", inputs=inputs)


if __name__ == "__main__":
    run_from_command_line(served, ServedParams)
