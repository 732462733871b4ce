"""Tokenize a completion run: one cached, retryable task per shard on a thread-pool task runner
(sharing one process pool for the CPU work), then per-shard / per-dataset stats, a histogram and
the data-quality gate, whose verdict is written beside the shards (`dataset.json`: passed or failed,
the failed checks, the sha256 of every shard it judged); training refuses shards it did not pass.
Reruns (scheduled or from the UI) redo only shards whose input, tokenizer or config changed, or
whose output is gone. Reports go to reports/tokenize/<dataset>/<run>/<flow run>/attempt-<n>/ (a retry never
overwrites a failed attempt's evidence); a failed gate ends the run with one error naming the dataset,
the failed checks and what to do.

Run: `python -m flows.tokenize --params '{"dataset": "demo", "run": "smollm2"}'`
"""

from __future__ import annotations

import json
from pathlib import Path

import polars as pl
from prefect import flow, get_run_logger
from prefect.runtime import flow_run
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.task_runners import ThreadPoolTaskRunner
from pydantic import BaseModel, Field

from dflash_core.data.verdict import DATASET_MANIFEST_NAME, DatasetManifest, verdict_from_problems
from dflash_core.embedded import embedded_tokenizer_dir
from dflash_core.layout import QUARANTINE_SUFFIX, ArtifactKind, artifact_key, is_manifest_key
from dflash_core.lineage import InputRef, write_artifact
from dflash_core.settings import load_settings
from dflash_core.storage import ObjectStore
from dflash_core.tokenize import (
    GateProblem, GateThresholds, QualityGateError, TargetTokenizer, TokenizeConfig, TokenizePool, check_gate,
    enforce_gate, histogram_png, stats_markdown, stats_rows, summarize,
)
from dflash_core.tokenize.stats import skip_reasons
from flows.command_line import run_from_command_line
from flows.failures import fail_run
from tasks.artifacts import artifact_record, stored_record, ui_key
from tasks.provenance import attempt_segments, flow_version, run_producer
from tasks.store import png_artifact
from tasks.tokenize import ShardSummary, summary_frames, tokenize_completion_shard


class TokenizeParams(BaseModel):
    dataset: str = Field("demo", description="Dataset name in S3 keys (completions/(dataset)/(run)/).")
    run: str = Field("smollm2", description="Completion run to tokenize.")
    output_run: str | None = Field(None, description="Tokenized run name (tokenized/(dataset)/(output_run)/); "
                                                     "default: run.")
    tokenizer_dir: str | None = Field(None, description="Local tokenizer/model dir of the target; None: the embedded SmolLM2.")
    chat_template: str | None = Field(None, description="Replace the tokenizer's chat template (rarely needed).")
    tokenize: TokenizeConfig = Field(default_factory=TokenizeConfig)
    gate: GateThresholds = Field(default_factory=GateThresholds)
    override_quality_gate: bool = Field(
        False, description="Finish the flow even when the quality gate fails (logged); the data stays marked failed "
        "and training refuses it unless the training run sets allow_failed_quality_gate.")
    workers: int | None = Field(None, ge=1, description="Tokenizer processes shared by all shards; None: every core.")


def _input_keys(store: ObjectStore, prefix: str) -> list[str]:
    return sorted(i.key for i in store.list(prefix) if i.key.endswith(".jsonl") and not is_manifest_key(i.key)
                  and not i.key.endswith(QUARANTINE_SUFFIX) and i.key.rsplit("/", 1)[-1].startswith("shard-"))


# Two shards in flight: one downloads/uploads while the other's chunks keep the process pool busy.
@flow(name="dflash-tokenize", log_prints=True, task_runner=ThreadPoolTaskRunner(max_workers=2), version=flow_version())
def tokenize(params: TokenizeParams = TokenizeParams()) -> dict:
    logger = get_run_logger()
    settings = load_settings()
    store = ObjectStore.from_settings(settings)
    store.check()
    in_prefix = artifact_key(settings.s3_prefixes, ArtifactKind.COMPLETIONS, params.dataset, params.run) + "/"
    out_run = params.output_run or params.run
    input_keys = _input_keys(store, in_prefix)
    if not input_keys:
        raise ValueError(f"no completion shards under {store.uri(in_prefix)}: check dataset={params.dataset!r} "
                         f"and run={params.run!r}, or run the generate flow first")
    tokenizer_dir = Path(params.tokenizer_dir) if params.tokenizer_dir else embedded_tokenizer_dir(settings.work_path("models"))
    target = TargetTokenizer.from_dir(tokenizer_dir, chat_template=params.chat_template)
    outputs = {key: artifact_key(settings.s3_prefixes, ArtifactKind.TOKENIZED, params.dataset, out_run,
                                 key.rsplit("/", 1)[-1].removesuffix(".jsonl") + ".arrow") for key in input_keys}
    with TokenizePool(target=target, config=params.tokenize, workers=params.workers) as pool:
        futures = []
        for input_key, output_key in outputs.items():
            # A missing output must be rebuilt, never replayed from the cache.
            run_task = tokenize_completion_shard if store.exists(output_key) else \
                tokenize_completion_shard.with_options(refresh_cache=True)
            futures.append(run_task.submit(settings, input_key=input_key, output_key=output_key, target=target,
                                           config=params.tokenize, pool=pool))
        summaries = [future.result() for future in futures]

    frames = [summary_frames(s) for s in summaries]
    samples = pl.concat([f[0] for f in frames], how="vertical_relaxed")
    skipped = pl.concat([f[1] for f in frames], how="vertical_relaxed")
    short = params.gate.short_loss_tokens
    by_shard, by_source, overall = (summarize(samples, skipped, by="shard", short_loss_tokens=short),
                                    summarize(samples, skipped, by="source", short_loss_tokens=short),
                                    summarize(samples, skipped, short_loss_tokens=short))
    for line in shard_log_lines(summaries, check_gate(by_shard, params.gate)):
        logger.info(line)
    problems = check_gate(pl.concat([by_source.rename({"source": "dataset"}), overall]), params.gate)
    verdict = verdict_from_problems(problems, overridden=params.override_quality_gate)
    name = f"{params.dataset}/{out_run}"
    report = {"inputs": input_keys, "outputs": list(outputs.values()), "by_shard": stats_rows(by_shard),
              "by_source": stats_rows(by_source), "overall": stats_rows(overall), "skip_reasons": skip_reasons(skipped),
              "gate": [p.message for p in problems], "quality_gate": verdict.verdict,
              "override_quality_gate": params.override_quality_gate}
    # Keyed by flow run and attempt: a retry or rerun never overwrites an earlier attempt's evidence.
    report_prefix = artifact_key(settings.s3_prefixes, ArtifactKind.REPORT, "tokenize", params.dataset, out_run,
                                 *attempt_segments())
    refs = [InputRef(uri=store.uri(s.output_key), sha256=s.output_sha256) for s in summaries]
    producer = run_producer()
    # The verdict, beside the shards it judged (by hash): the trainer trains only on passed shards.
    dataset_key = artifact_key(settings.s3_prefixes, ArtifactKind.TOKENIZED, params.dataset, out_run,
                               DATASET_MANIFEST_NAME)
    dataset_manifest = DatasetManifest(
        dataset=params.dataset, run=out_run, gate=verdict, thresholds=params.gate.model_dump(),
        shards={s.output_key.rsplit("/", 1)[-1]: s.output_sha256 for s in summaries},
        samples=sum(s.samples for s in summaries), report=store.uri(f"{report_prefix}/stats.json"))
    stored = [
        write_artifact(store, dataset_key, dataset_manifest.to_bytes(), kind=ArtifactKind.TOKENIZED, inputs=refs,
                       config={"quality_gate": verdict.verdict}, producer=producer),
        write_artifact(store, f"{report_prefix}/stats.json", json.dumps(report, indent=2, default=str).encode(),
                       kind=ArtifactKind.REPORT, inputs=refs, config=params, producer=producer),
        write_artifact(store, f"{report_prefix}/loss-histogram.png",
                       histogram_png(samples, title=f"{name}: loss tokens per sample"),
                       kind=ArtifactKind.REPORT, inputs=refs, config=params, producer=producer),
    ]
    _publish_stats(params, name=name, by_shard=by_shard, by_source=by_source, overall=overall, skipped=skipped,
                   problems=problems, verdict=verdict.verdict, png=store.get_bytes(stored[2].key))
    try:
        tokenized_uri = store.uri(artifact_key(settings.s3_prefixes, ArtifactKind.TOKENIZED, params.dataset, out_run))
        warnings = enforce_gate(problems, override=params.override_quality_gate, dataset=f"{name} ({tokenized_uri}/)")
    except QualityGateError as error:
        return fail_run(error)
    for warning in warnings:
        logger.warning(warning)
    print(f"tokenized {len(outputs)} shards into {store.uri(artifact_key(settings.s3_prefixes, ArtifactKind.TOKENIZED, params.dataset, out_run))}/")
    records = [stored_record(store.uri(s.output_key), kind=ArtifactKind.TOKENIZED, sha256=s.output_sha256)
               for s in summaries] + [artifact_record(m) for m in stored]
    return {"outputs": list(outputs.values()), "overall": stats_rows(overall)[0] if overall.height else {},
            "gate": [p.message for p in problems], "quality_gate": verdict.verdict,
            "dataset_manifest": store.uri(dataset_key), "report": stored[1].uri, "artifacts": records,
            "flow_run": str(flow_run.id or "")}


def shard_log_lines(summaries: list[ShardSummary], shard_problems: list[GateProblem]) -> list[str]:
    """One line per shard: samples, skipped lines by reason, and the gate's thresholds applied to the shard
    alone (the verdict that counts is the dataset's, below)."""
    failed: dict[str, list[str]] = {}
    for problem in shard_problems:
        failed.setdefault(problem.dataset, []).append(problem.check)
    lines = []
    for summary in summaries:
        shard = summary.output_key.rsplit("/", 1)[-1]
        skipped = ", ".join(f"{reason} {count}" for reason, count in sorted(summary.skipped.items()) if count) or "none"
        checks = failed.get(shard)
        gate = f"fails {', '.join(checks)}" if checks else "passes"
        lines.append(f"{shard}: {summary.samples} samples, skipped {skipped}; on its own the gate {gate}")
    return lines


def _publish_stats(params: TokenizeParams, *, name: str, by_shard, by_source, overall, skipped, problems,
                   verdict: str, png: bytes) -> None:
    """Table, markdown and histogram artifacts, keyed by dataset/run so one run's never replaces another's."""
    create_table_artifact(stats_rows(pl.concat([by_source.rename({"source": "dataset"}), overall])),
                          key=ui_key("tokenize-stats", params.dataset, params.output_run or params.run),
                          description=f"{name}: per dataset and overall")
    overridden = " (overridden: the run finished, training still refuses it)" if problems and params.override_quality_gate else ""
    create_markdown_artifact(
        f"## Tokenized {name}\n\n### Quality gate: {verdict}{overridden}\n"
        + ("\n".join(f"- {p.message}" for p in problems) or "every check passed")
        + f"\n\n### Per dataset\n{stats_markdown(by_source)}\n\n### Overall\n{stats_markdown(overall)}\n\n"
        f"### Per shard\n{stats_markdown(by_shard)}\n\n### Skipped lines\n{json.dumps(skip_reasons(skipped))}\n",
        key=ui_key("tokenize-report", params.dataset, params.output_run or params.run))
    png_artifact(png, key=ui_key("tokenize-loss-histogram", params.dataset, params.output_run or params.run),
                 description=f"{name}: loss tokens per sample, per source dataset")


if __name__ == "__main__":
    run_from_command_line(tokenize, TokenizeParams)
