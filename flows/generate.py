"""Generate on-policy completions: (import prompts) -> launch servers -> canary -> one task per
prompt shard -> stop servers (also when the flow fails or is cancelled) -> a run report
(reports/generate/<dataset>/<run>/<flow run>/attempt-<n>/summary.json, so a retry never overwrites a failed
attempt's). More failed prompts than `max_failed_fraction` fail the flow (counts and first errors);
fewer leave a warning artifact. The import holds out a seeded share of each source's prompts
(`holdout`) in shards of their own; their completions are the evaluation split, never trained on.
The result is a `CompletionsDataset` (dflash_core/stage_results.py), also stored as result.json
beside the report, which the tokenize stage takes as its input.

Run: `dflash run generate --params '{"prompt_sources": [{"path": "prompts.jsonl", "name": "mine"}]}'`
"""

from __future__ import annotations

from pathlib import Path

from prefect import flow, get_run_logger
from prefect.runtime import flow_run

from dflash_core.data.prompts import PromptSource
from dflash_core.layout import HELDOUT_STEM, ArtifactKind, artifact_key, downstream_shard_name, is_heldout_key
from dflash_core.lineage import InputRef
from dflash_core.serving import launcher
from dflash_core.serving.generation import (
    GenerationFailed, GenerationTarget, ShardAssignment, failure_verdict, shard_is_done,
)
from dflash_core.serving.profiles import TransformersProfile
from dflash_core.settings import load_settings
from dflash_core.stage_results import RESULT_FILE, CompletionsDataset, StoredShard
from dflash_core.storage import ObjectStore
from flows.command_line import run_from_command_line
from flows.failures import fail_run
from flows.generate_nodes import NodesLost, answer_across_nodes, credit_shards, merged_shards
from flows.generate_params import GenerateParams
from flows.nodes import preserve_on_failure
from tasks.artifacts import target_inputs, ui_key
from tasks.generate import (
    generate_completion_shard, import_prompt_set, launch_servers, new_progress, prompt_ids, publish_generation_report,
    report_failures, run_canary, stop_servers,
)
from tasks.provenance import attempt_segments, flow_version
from tasks.results import store_result


def _run_dir(settings, run: str) -> Path:
    return settings.work_path("servers", run)


def _stop_on_exit(flow_obj, flow_run_obj, state) -> None:
    params = flow_run_obj.parameters.get("params") or {}
    run = params.run if isinstance(params, GenerateParams) else params.get("run")
    if run:
        launcher.stop_recorded(_run_dir(load_settings(), run))


@flow(name="dflash-generate", log_prints=True, version=flow_version(), on_failure=[_stop_on_exit, preserve_on_failure],
      on_cancellation=[_stop_on_exit, preserve_on_failure], on_crashed=[_stop_on_exit, preserve_on_failure])
def generate(params: GenerateParams) -> CompletionsDataset:
    settings = load_settings()
    store = ObjectStore.from_settings(settings)
    store.check()
    if params.prompt_sources:
        sources = [PromptSource(Path(s.path), s.name, s.weight, turns=s.turns, max_chars=s.max_chars) for s in params.prompt_sources]
        prompt_keys = import_prompt_set(settings, sources=sources, dataset=params.dataset,
                                        version=params.prompts_version, total=params.total_prompts,
                                        shard_size=params.shard_size, seed=params.seed, holdout=params.holdout)
    else:
        prefix = artifact_key(settings.s3_prefixes, ArtifactKind.PROMPTS, params.dataset, params.prompts_version) + "/"
        prompt_keys = sorted((i.key for i in store.list(prefix) if i.key.endswith(".jsonl") and
                              i.key.rsplit("/", 1)[-1].startswith(("prompts-", f"{HELDOUT_STEM}-"))),
                             key=lambda key: (is_heldout_key(key), key))
        if not prompt_keys:
            raise ValueError(f"no prompt shards under {store.uri(prefix)}: pass prompt_sources to import some")
    if params.prompt_shards is not None:
        prompt_keys = _given_shards(store, params.prompt_shards, available=prompt_keys)
    heldout_ids = prompt_ids(settings, [key for key in prompt_keys if is_heldout_key(key)])
    output_keys = [artifact_key(settings.s3_prefixes, ArtifactKind.COMPLETIONS, params.dataset, params.run,
                                downstream_shard_name(key, suffix="jsonl")) for key in prompt_keys]
    report_prefix = artifact_key(settings.s3_prefixes, ArtifactKind.REPORT, "generate", params.dataset, params.run,
                                 *attempt_segments())
    if params.nodes:
        return _across_nodes(settings, params, prompt_keys=prompt_keys, output_keys=output_keys,
                             heldout_ids=heldout_ids, report_prefix=report_prefix)

    profile = params.engine or TransformersProfile(model=str(_embedded_model(settings)))
    planned = GenerationTarget(urls=[], model=profile.request_model, server=profile.engine,
                               sampling=params.sampling, client=params.client)
    ui = {kind: ui_key(kind, params.dataset, params.run) for kind in ("inference-endpoints", "generation-canary",
                                                                       "generation-failures")}
    report_key = f"{report_prefix}/summary.json"
    if not params.refresh and all(shard_is_done(store, prompt_key=p, output_key=o, target=planned)
                                  for p, o in zip(prompt_keys, output_keys)):
        get_run_logger().info("every shard is already generated with this model and sampling: no server started")
        summary = {"shards": output_keys, "completed": None, "failed": 0, "generated_now": 0,
                   "completion_tokens_now": 0, "flow_run": str(flow_run.id or "")}
        records = publish_generation_report(settings, key=report_key, report=summary, shard_keys=output_keys)
        return _result(settings, params, summary, records, report_key=report_key, heldout_ids=heldout_ids,
                       result_key=f"{report_prefix}/{RESULT_FILE}", model=profile.model)
    run_dir = _run_dir(settings, params.run)
    urls = launch_servers(profile, num_instances=params.num_instances, base_port=params.base_port,
                          run_dir=run_dir, devices=params.devices, ui_artifact=ui["inference-endpoints"])
    try:
        target = GenerationTarget(urls=urls, model=profile.request_model, server=profile.engine,
                                  sampling=params.sampling, client=params.client,
                                  api_key=profile.api_key.get_secret_value() if profile.api_key else None)
        if params.canary_prompts:
            run_canary(settings, prompt_key=prompt_keys[0], target=target, count=params.canary_prompts,
                       thresholds=params.canary, ui_artifact=ui["generation-canary"])
        outcomes = []
        deal = _own_deal(params)
        for index, (prompt_key, output_key) in enumerate(zip(prompt_keys, output_keys)):
            progress = new_progress(f"shard {index + 1}/{len(prompt_keys)}: {output_key}")
            run_shard = generate_completion_shard.with_options(refresh_cache=True) if params.refresh \
                else generate_completion_shard
            outcomes.append(run_shard(settings, prompt_key=prompt_key, output_key=output_key,
                                      target=target, progress_id=progress,
                                      assignment=ShardAssignment(node=params.node.name, deal=deal) if deal else None))
    finally:
        stop_servers(run_dir)
    summary = {"shards": [o.output_key for o in outcomes if o.completed],
               "completed": sum(o.completed for o in outcomes),
               "failed": sum(o.failed for o in outcomes), "generated_now": sum(o.generated_now for o in outcomes),
               "completion_tokens_now": sum(o.completion_tokens_now for o in outcomes),
               "flow_run": str(flow_run.id or "")}
    try:
        warning = failure_verdict(outcomes, max_failed_fraction=params.max_failed_fraction)
    except GenerationFailed as failed:
        # The failed attempt's evidence stays under its own flow run; a retry writes beside it.
        publish_generation_report(settings, key=report_key, report={**summary, "verdict": str(failed)},
                                  shard_keys=summary["shards"])
        return fail_run(failed)
    if warning:
        report_failures(warning, run=params.run, ui_artifact=ui["generation-failures"])
    records = publish_generation_report(settings, key=report_key, report={**summary, "verdict": warning or "ok"},
                                        shard_keys=summary["shards"])
    get_run_logger().info("generation summary: %s", summary)
    return _result(settings, params, summary, records, report_key=report_key, heldout_ids=heldout_ids,
                   result_key=f"{report_prefix}/{RESULT_FILE}", model=profile.model)


def _own_deal(params: GenerateParams) -> str | None:
    """This node share's deal, the idempotency key its generate run across nodes started it with and wrote into each
    of its shards' assignments; None for a run that is no such share."""
    if params.node is None or params.prompt_shards is None or not flow_run.id:
        return None
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        return client.read_flow_run(flow_run.id).idempotency_key


def _given_shards(store: ObjectStore, keys: list[str], *, available: list[str]) -> list[str]:
    """`prompt_shards`, each checked to be a shard of this prompt set."""
    unknown = [key for key in keys if key not in set(available)]
    if unknown:
        raise ValueError(f"prompt_shards names shards that are not in this prompt set: "
                         f"{[store.uri(key) for key in unknown]}; its shards: {[store.uri(k) for k in available]}")
    return list(keys)


def _across_nodes(settings, params: GenerateParams, *, prompt_keys: list[str], output_keys: list[str],
                  heldout_ids: list[str], report_prefix: str) -> CompletionsDataset:
    """Answer the prompt shards on the form's nodes (flows/generate_nodes.py) and merge what they made into one
    result: every stored shard once, the held-out ids of the import, counts per node."""
    store = ObjectStore.from_settings(settings)
    try:
        by_node = answer_across_nodes(settings, params, prompt_keys=prompt_keys, output_keys=output_keys)
    except NodesLost as lost:
        return fail_run(lost)
    stored = merged_shards(store, output_keys)
    by_node = credit_shards(store, by_node, stored)
    totals: dict[str, int] = {}
    for share in by_node:
        for name, count in share.outcomes.items():
            totals[name] = totals.get(name, 0) + count
    summary = {"shards": stored, **totals, "flow_run": str(flow_run.id or ""),
               "by_node": [share.model_dump(mode="json") for share in by_node]}
    if totals.get("failed"):
        report_failures(f"{totals['failed']} prompt(s) failed on the nodes (each node's run says which; a rerun "
                        f"retries them)", run=params.run, ui_artifact=ui_key("generation-failures", params.dataset,
                                                                              params.run))
    report_key = f"{report_prefix}/summary.json"
    records = publish_generation_report(settings, key=report_key, report=summary, shard_keys=stored)
    get_run_logger().info("generation across %d node(s): %s", len(by_node),
                          "; ".join(f"{s.node}: {len(s.shards)} shard(s), {s.outcomes}" + (f" (lost: {s.lost})"
                                                                                            if s.lost else "")
                                    for s in by_node))
    engine = params.engine or next(spec.engine for spec in params.nodes if spec.engine is not None)
    return _result(settings, params, summary, records, report_key=report_key, heldout_ids=heldout_ids,
                   result_key=f"{report_prefix}/{RESULT_FILE}", model=engine.model, by_node=by_node)


def _result(settings, params: GenerateParams, summary: dict, records: list[dict], *, report_key: str,
            heldout_ids: list[str], result_key: str, model: str, by_node=()) -> CompletionsDataset:
    """The stage's typed result, stored as result.json beside the report; the served model, when it is a local
    dir, among its inputs (its files by sha256)."""
    store = ObjectStore.from_settings(settings)
    by_uri = {record["uri"]: record for record in records}
    shards = [StoredShard(uri=store.uri(key), sha256=by_uri[store.uri(key)]["sha256"],
                          split="heldout" if is_heldout_key(key) else "train") for key in summary["shards"]]
    outcomes = {name: summary[name] for name in ("completed", "failed", "generated_now", "completion_tokens_now")
                if summary.get(name) is not None}
    result = CompletionsDataset(dataset=params.dataset, run=params.run, shards=shards, heldout_prompt_ids=heldout_ids,
                                outcomes=outcomes, report=store.uri(report_key), flow_run=str(flow_run.id or ""),
                                artifacts=records, by_node=list(by_node))
    served = target_inputs(settings, model, seed=0) if Path(model).is_dir() else []
    return store_result(settings, result, key=result_key,
                        inputs=[*(InputRef(uri=s.uri, sha256=s.sha256) for s in shards), *served])


def _embedded_model(settings) -> Path:
    from dflash_core.embedded import embedded_model_dir

    return embedded_model_dir(settings.work_path("models"))



if __name__ == "__main__":
    run_from_command_line(generate, GenerateParams)
