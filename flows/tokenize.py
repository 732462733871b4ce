"""Tokenize a completion run: one cached, retryable task per shard on a thread-pool task runner
(sharing one process pool for the CPU work), then per-shard / per-dataset stats, a histogram and
the data-quality gate, whose verdict is written beside the shards (`dataset.json`: passed or failed,
the failed checks, the sha256 of every shard it judged); training refuses shards it did not pass.
Reruns (scheduled or from the UI) redo only shards whose input, tokenizer or config changed, or
whose output is gone. Reports go to reports/tokenize/<dataset>/<run>/<flow run>/attempt-<n>/ (a retry never
overwrites a failed attempt's evidence); a failed gate ends the run with one error naming the dataset,
the failed checks and what to do.

Its input is the generate stage's result (a `CompletionsDataset`, or the URI of its result.json, or the
URI of a completion run's prefix); held-out completion shards become held-out tokenized shards, and
no training shard may hold a held-out prompt id. The result is a `TokenizedDataset`, stored as
result.json beside the reports, which the train stage takes as its input.

Run: `dflash run tokenize --params '{"completions": "s3://dflash/reports/generate/.../result.json"}'`
"""

from __future__ import annotations

import json
from pathlib import Path

import polars as pl
from prefect import flow, get_run_logger
from prefect.runtime import flow_run
from prefect.task_runners import ThreadPoolTaskRunner
from pydantic import Field

from dflash_core.data.verdict import DATASET_MANIFEST_NAME, DatasetManifest, verdict_from_problems
from dflash_core.embedded import embedded_tokenizer_dir
from dflash_core.layout import ArtifactKind, artifact_key, downstream_shard_name, is_heldout_key
from dflash_core.lineage import InputRef
from dflash_core.settings import load_settings
from dflash_core.stage_results import RESULT_FILE, CompletionsDataset, StoredShard, TokenizedDataset
from dflash_core.storage import ObjectStore
from dflash_core.strict import StrictModel
from dflash_core.tokenize import (
    GateThresholds, QualityGateError, TargetTokenizer, TokenizeConfig, TokenizePool, check_gate, enforce_gate,
    find_duplicates, histogram_png, stats_rows, summarize,
)
from dflash_core.tokenize.stats import skip_reasons
from flows.command_line import run_from_command_line
from flows.failures import fail_run
from tasks.artifacts import NewArtifact, artifact_record, store_artifacts, stored_record, tokenizer_inputs
from tasks.provenance import attempt_segments, flow_version
from tasks.results import store_result
from tasks.tokenize import read_completion_ids, summary_frames, tokenize_completion_shard
from tasks.tokenize_inputs import check_no_heldout_in_training, resolve_completions
from tasks.tokenize_report import publish_stats, shard_log_lines


class TokenizeParams(StrictModel):
    completions: CompletionsDataset | str | None = Field(None, description=(
        "What to tokenize: the generate stage's result (the pipeline passes it), or the S3 URI of its result.json, "
        "or of a completion run's prefix (s3://BUCKET/completions/DATASET/RUN/)."))
    output_run: str | None = Field(None, description="Tokenized run name (tokenized/(dataset)/(output_run)/); "
                                                     "default: the completion run's name.")
    tokenizer_dir: str | None = Field(None, description="Local tokenizer/model dir of the target; None: the embedded SmolLM2.")
    chat_template: str | None = Field(None, description="Replace the tokenizer's chat template (rarely needed).")
    tokenize: TokenizeConfig = Field(default_factory=TokenizeConfig)
    gate: GateThresholds = Field(default_factory=GateThresholds)
    override_quality_gate: bool = Field(
        False, description="Finish the flow even when the quality gate fails (logged); the data stays marked failed "
        "and training refuses it unless the training run sets allow_failed_quality_gate.")
    workers: int | None = Field(None, ge=1, description="Tokenizer processes shared by all shards; None: every core.")
    refresh: bool = Field(False, description=(
        "Tokenize every shard again, ignoring cached results: how to rerun a finished tokenization (the server "
        "refuses Retry on a Completed run, behind a success toast in the UI). Without it a rerun redoes only shards whose input, tokenizer or config "
        "changed."))


# Two shards in flight: one downloads/uploads while the other's chunks keep the process pool busy.
@flow(name="dflash-tokenize", log_prints=True, task_runner=ThreadPoolTaskRunner(max_workers=2), version=flow_version())
def tokenize(params: TokenizeParams = TokenizeParams()) -> TokenizedDataset:
    logger = get_run_logger()
    settings = load_settings()
    store = ObjectStore.from_settings(settings)
    store.check()
    if params.completions is None:
        example = artifact_key(settings.s3_prefixes, ArtifactKind.COMPLETIONS, "DATASET", "RUN")
        raise ValueError(f"tokenize needs completions: the generate stage's result, the URI of its result.json, or "
                         f"a completion run's prefix ({store.uri(example)}/)")
    completions = resolve_completions(settings, params.completions)
    if not completions.shards:
        raise ValueError(f"no completion shards in {completions.result_uri or completions.report or completions.run}: "
                         f"run the generate stage first")
    out_run = params.output_run or completions.run
    input_keys = [store.key_of(s.uri) for s in completions.shards]
    tokenizer_dir = Path(params.tokenizer_dir) if params.tokenizer_dir else embedded_tokenizer_dir(settings.work_path("models"))
    target = TargetTokenizer.from_dir(tokenizer_dir, chat_template=params.chat_template)
    outputs = {key: artifact_key(settings.s3_prefixes, ArtifactKind.TOKENIZED, completions.dataset, out_run,
                                 downstream_shard_name(key, suffix="arrow")) for key in input_keys}
    ids = {key: future.result() for key, future in [  # one id per line, in shard order
        (key, read_completion_ids.submit(settings, input_key=key, max_record_bytes=params.tokenize.max_record_bytes))
        for key in input_keys]}
    # The held-out ids: those the generate result names, and those of the held-out shards themselves.
    heldout_ids = list(dict.fromkeys([*completions.heldout_prompt_ids,
                                      *(i for key, line_ids in ids.items() if is_heldout_key(key) for i in line_ids if i)]))
    check_no_heldout_in_training(ids, heldout_ids=set(heldout_ids))
    # The splits apart: an id in both is a held-out leak (refused above), not a duplicate to drop.
    duplicates = {**find_duplicates({k: v for k, v in ids.items() if is_heldout_key(k)}),
                  **find_duplicates({k: v for k, v in ids.items() if not is_heldout_key(k)})}
    with TokenizePool(target=target, config=params.tokenize, workers=params.workers) as pool:
        futures = []
        for input_key, output_key in outputs.items():
            # A missing output must be rebuilt, never replayed from the cache.
            run_task = tokenize_completion_shard if store.exists(output_key) and not params.refresh else \
                tokenize_completion_shard.with_options(refresh_cache=True)
            futures.append(run_task.submit(settings, input_key=input_key, output_key=output_key, target=target,
                                           config=params.tokenize, pool=pool, duplicates=duplicates.get(input_key, {})))
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
    name = f"{completions.dataset}/{out_run}"
    report = {"inputs": input_keys, "outputs": list(outputs.values()), "by_shard": stats_rows(by_shard),
              "by_source": stats_rows(by_source), "overall": stats_rows(overall), "skip_reasons": skip_reasons(skipped),
              "gate": [p.message for p in problems], "quality_gate": verdict.verdict,
              "override_quality_gate": params.override_quality_gate}
    # Keyed by flow run and attempt: a retry or rerun never overwrites an earlier attempt's evidence.
    report_prefix = artifact_key(settings.s3_prefixes, ArtifactKind.REPORT, "tokenize", completions.dataset, out_run,
                                 *attempt_segments())
    refs = [InputRef(uri=store.uri(s.output_key), sha256=s.output_sha256) for s in summaries]
    # The verdict, beside the shards it judged (by hash): the trainer trains only on passed shards. The tokenizer
    # that made them is among its inputs (its files by sha256).
    dataset_key = artifact_key(settings.s3_prefixes, ArtifactKind.TOKENIZED, completions.dataset, out_run,
                               DATASET_MANIFEST_NAME)
    dataset_manifest = DatasetManifest(
        dataset=completions.dataset, run=out_run, gate=verdict, thresholds=params.gate.model_dump(),
        shards={s.output_key.rsplit("/", 1)[-1]: s.output_sha256 for s in summaries},
        samples=sum(s.samples for s in summaries), report=store.uri(f"{report_prefix}/stats.json"))
    params_json = params.model_dump(mode="json")
    stored = store_artifacts(settings, [
        NewArtifact(key=dataset_key, data=dataset_manifest.to_bytes(), kind=ArtifactKind.TOKENIZED,
                    inputs=[*refs, *tokenizer_inputs(settings, tokenizer_dir)],
                    config={"quality_gate": verdict.verdict}),
        NewArtifact(key=f"{report_prefix}/stats.json", data=json.dumps(report, indent=2, default=str).encode(),
                    kind=ArtifactKind.REPORT, inputs=refs, config=params_json),
        NewArtifact(key=f"{report_prefix}/loss-histogram.png", kind=ArtifactKind.REPORT, inputs=refs,
                    config=params_json, data=histogram_png(samples, title=f"{name}: loss tokens per sample")),
    ])
    publish_stats(override=params.override_quality_gate, name=name, by_shard=by_shard, by_source=by_source, overall=overall, skipped=skipped,
                   problems=problems, verdict=verdict.verdict, png=store.get_bytes(stored[2].key))
    tokenized_uri = store.uri(artifact_key(settings.s3_prefixes, ArtifactKind.TOKENIZED, completions.dataset, out_run))
    try:
        warnings = enforce_gate(problems, override=params.override_quality_gate, dataset=f"{name} ({tokenized_uri}/)")
    except QualityGateError as error:
        return fail_run(error)
    for warning in warnings:
        logger.warning(warning)
    shards = [StoredShard(uri=store.uri(s.output_key), sha256=s.output_sha256,
                          split="heldout" if is_heldout_key(s.output_key) else "train") for s in summaries]
    print(f"tokenized {len(outputs)} shards into {tokenized_uri}/ "
          f"({sum(s.split == 'heldout' for s in shards)} held out)")
    records = [stored_record(s.uri, kind=ArtifactKind.TOKENIZED, sha256=s.sha256) for s in shards] + \
        [artifact_record(m) for m in stored]
    result = TokenizedDataset(
        dataset=completions.dataset, run=out_run, train_shards=[s for s in shards if s.split == "train"],
        heldout_shards=[s for s in shards if s.split == "heldout"], heldout_prompt_ids=heldout_ids,
        dataset_manifest=store.uri(dataset_key), quality_gate=verdict.verdict, gate=[p.message for p in problems],
        stats=stored[1].uri, histogram=stored[2].uri, overall=stats_rows(overall)[0] if overall.height else {},
        completions=completions.result_uri, flow_run=str(flow_run.id or ""), artifacts=records)
    return store_result(settings, result, key=f"{report_prefix}/{RESULT_FILE}", inputs=refs)


if __name__ == "__main__":
    run_from_command_line(tokenize, TokenizeParams)
