"""The summary `dflash demo` ends with, rendered from a real pipeline result: a pipeline run (plan +
tokenize) on the real Prefect and S3 servers, its stage runs read back over the REST API, and what
`python -m flows.launch` prints parsed the way `dflash run` parses it. The drafter rows come from a
result shaped like the evaluate flow's return. The summary the run publishes on its own page (just
before it ends, while the server still says Running) states how it ends: Completed, or Failed with the
stage's error, after the time since it started (UTC), and how to rerun a finished stage.

Run: `.venv/bin/python -m pytest -q tests/integration/test_run_summary.py`
"""

from __future__ import annotations

import re
import time
import uuid

from rich.console import Console

from dflash_core import run_summary
from tests.integration.test_tokenize_flow import put_shards, shard
from tests.unit.conftest_tokenize import MODEL_CACHE


def _text(renderable) -> str:
    console = Console(record=True, width=260, color_system=None)
    console.print(renderable)
    return console.export_text()


def _published_summary(flow_run_id: str) -> str:
    """The pipeline-summary artifact the run published on its own page."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterKey

    with get_client(sync_client=True) as client:
        [artifact] = client.read_artifacts(artifact_filter=ArtifactFilter(
            key=ArtifactFilterKey(any_=["pipeline-summary"]), flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id])))
    return artifact.data


def _seconds(duration: str) -> float:
    """Seconds of a duration as the summary prints it (3m 20s, 12.5s)."""
    minutes, seconds = re.fullmatch(r"(?:(\d+)m )?([\d.]+)s", duration).groups()
    return int(minutes or 0) * 60 + float(seconds)


def test_the_summary_renders_from_a_real_pipeline_run(prefect_server, store, env_settings):
    from dflash_core.embedded import embedded_tokenizer_dir
    from dflash_core.tokenize import GateThresholds
    from flows.pipeline import PipelineParams, pipeline
    from flows.command_line import result_json
    from flows.tokenize import TokenizeParams

    dataset = f"summary-{uuid.uuid4().hex[:8]}"
    put_shards(store, env_settings, dataset, [shard(0), shard(1)])
    tokenization = TokenizeParams(completions=f"s3://{store.bucket}/completions/{dataset}/run-a/",
                                  tokenizer_dir=str(embedded_tokenizer_dir(MODEL_CACHE)), workers=1,
                                  gate=GateThresholds(max_skipped_fraction=0.1))
    started = time.monotonic()
    state = pipeline(PipelineParams(tokenization=tokenization), return_state=True)
    took = time.monotonic() - started
    assert state.is_completed(), state
    flow_run_id = str(state.state_details.flow_run_id)
    published = _published_summary(flow_run_id)
    row = re.search(r"^\| pipeline \| (\w+) \| ([^|]+) \|", published, re.M)
    assert row and row.group(1) == "Completed", published  # not "Running", as the server said at that moment
    assert 0 < _seconds(row.group(2).strip()) <= took
    assert re.search(r"\*\*pipeline Completed after [^*]+ \(started \d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC\)\*\*",
                     published), published
    assert "## Running a stage again" in published and "refresh=true" in published
    assert "Run is already COMPLETED" in published
    # What flows.launch prints: the link first, logs, then the result as indented JSON.
    printed = [f"dflash-pipeline/embedded-demo: flow run x http://127.0.0.1:4200/runs/flow-run/{flow_run_id}\n",
               "12:00:00                     pipeline | {not json\n",
               *result_json(state.result()).splitlines(keepends=True)]
    parsed_id, result = run_summary.parse_launch_output(printed)
    assert parsed_id == flow_run_id and result["report"] == state.result().report

    stages = run_summary.read_stage_runs(env_settings.prefect_api_url, flow_run_id)
    assert [(s.stage, s.depth, s.state) for s in stages] == [("pipeline", 0, "Completed"), ("tokenize", 1, "Completed")]
    assert all(s.seconds and s.seconds > 0 for s in stages)
    assert stages[1].url == f"{env_settings.prefect_api_url.removesuffix('/api')}/runs/flow-run/{stages[1].id}"

    text = _text(run_summary.summary(result, stages))
    assert "tokenize" in text and "Completed" in text
    assert "12 samples in 2 training + 0 held-out shards, quality gate passed" in text
    assert result["report"] in text and stages[1].url in text and stages[0].url in text
    assert f"s3://{store.bucket}/tokenized/{dataset}/run-a/" in text  # where the tokenized shards live
    assert "no evaluation in this run" in text


def test_a_failed_pipeline_publishes_failed_with_the_stages_error(prefect_server, store, env_settings):
    from flows.pipeline import PipelineParams, pipeline
    from flows.tokenize import TokenizeParams

    empty = f"s3://{store.bucket}/completions/summary-empty-{uuid.uuid4().hex[:8]}/run-a/"
    state = pipeline(PipelineParams(tokenization=TokenizeParams(completions=empty)), return_state=True)
    assert state.is_failed(), state
    published = _published_summary(str(state.state_details.flow_run_id))
    assert re.search(r"^\| pipeline \| Failed \| [^|-]+ \|", published, re.M), published
    assert "**pipeline Failed after" in published and "UTC)**" in published
    why = next(line for line in published.splitlines() if line.startswith("Why: "))
    assert "stage tokenize ended Failed" in why and "no completion shards" in why


def test_a_failed_launch_still_names_the_run():
    lines = ["dflash-pipeline/embedded-demo: flow run x http://h/runs/flow-run/0b7c6a5e-1f2d-4c3b-9a8e-7d6c5b4a3f21\n",
             "dflash-pipeline/embedded-demo: Failed: stage tokenize ...\n"]
    assert run_summary.parse_launch_output(lines) == ("0b7c6a5e-1f2d-4c3b-9a8e-7d6c5b4a3f21", None)
    text = _text(run_summary.summary(None, [run_summary.StageRun("pipeline", "x", "id", "Failed", 3.0, "http://u", 0)]))
    assert "Failed" in text and "http://u" in text and "nothing stored" in text


def test_tau_speedup_and_folded_checkpoint_files():
    ckpt = "s3://b/checkpoints/demo-drafter/step-000020"
    training = {
        "uri": ckpt, "step": 20, "data": [{"uri": "s3://b/tokenized/d/r/shard-00000.arrow", "sha256": "d" * 64}],
        "artifacts": [{"uri": f"{ckpt}/model.safetensors", "kind": "checkpoint", "sha256": "a" * 64},
                      {"uri": f"{ckpt}/meta.json", "kind": "checkpoint", "sha256": "b" * 64},
                      {"uri": "s3://b/reports/train/demo-drafter/metrics.json", "kind": "report", "sha256": "c" * 64}]}
    evaluation = {"report": "s3://b/reports/evaluate/x/report.json", "split": "heldout",
                  "summaries": [{"mode": "block", "num_responses": 8, "tau": 1.2345, "speedup": 0.61,
                                 "tokens_per_s": 9.87, "all_match_target": True},
                                {"mode": "tree", "num_responses": 8, "tau": 1.5, "speedup": 0.7, "tokens_per_s": 11.0,
                                 "all_match_target": False, "exact_matches": 6, "near_ties": 2, "divergences": 0}]}
    stages = [run_summary.StageRun("pipeline", "p", "1", "Completed", 200.0, "u0", 0),
              run_summary.StageRun("train", "p-train", "2", "Completed", 95.0, "u1", 1),
              run_summary.StageRun("evaluate", "p-evaluate", "3", "Completed", 30.0, "u2", 1),
              run_summary.StageRun("export", "p-export", "4", "Completed", 4.0, "u3", 1)]
    export = {"exports": {"native": "s3://b/exports/demo-drafter/native"}, "artifacts": []}
    text = _text(run_summary.summary({"report": "s3://b/reports/plan/p.json", "training": training,
                                      "evaluation": evaluation, "export": export}, stages))
    assert "1.234" in text and "0.61x" in text and "│ yes" in text and "target, on held-out prompts" in text
    assert "6/8 exact, 2 near-ties" in text  # bf16 near-ties are told apart from a real divergence
    assert "on heldout prompts: block: tau 1.234" in text
    assert f"checkpoint {ckpt} (step 20, 1 shards)" in text
    assert "native s3://b/exports/demo-drafter/native" in text
    assert f"{ckpt}/" in text and "3m 20s" in text and "1m 35s" in text
    rows = [line for line in text.splitlines() if f"{ckpt}/" in line]
    assert len(rows) == 1 and rows[0].rstrip(" │").endswith("2"), "a checkpoint's files fold into one row"


def test_a_retried_run_is_timed_by_its_latest_attempt_and_says_since_the_first(prefect_server, env_settings):
    """A run that failed, waited and was retried: its row gives the latest attempt's time, then the attempt and the
    time since the first started; the pipeline's own row (settled as it ends) and outcome line too."""
    from datetime import UTC, datetime

    from prefect import flow
    from prefect.client.orchestration import get_client
    from prefect.states import AwaitingRetry, Completed, Failed, Running

    @flow(name="dflash-retried-probe")
    def probe() -> None:
        pass

    with get_client(sync_client=True) as client:
        run = client.create_flow_run(probe, name="retried-run")
        for state, then_wait_s in ((Running, 3.0), (Failed, 2.0), (AwaitingRetry, 0), (Running, 1.0), (Completed, 0)):
            client.set_flow_run_state(run.id, state(), force=True)
            time.sleep(then_wait_s)
    [row] = run_summary.read_stage_runs(env_settings.prefect_api_url, str(run.id))
    assert row.attempt == 2
    assert 0.9 <= row.seconds < 2.5, row  # the latest attempt, not the 4 s both ran nor the 6 s since the first
    assert 5.9 <= row.since_first_s < 9, row
    assert re.fullmatch(r"[12]\.\ds \(attempt 2; [6-8]\.\ds since the first\)", run_summary.duration_cell(row)), row
    [settled] = run_summary.settle_pipeline([row], state="Completed", now=datetime.now(UTC))
    assert settled.seconds < settled.since_first_s - 4, settled
    outcome = run_summary.outcome_line([settled])
    assert re.fullmatch(r"pipeline Completed after [12]\.\ds, attempt 2 \(started \d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC; "
                        r"[6-9]\.\ds since the first attempt started \d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC\)", outcome), \
        outcome
