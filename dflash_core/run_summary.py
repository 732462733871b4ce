"""The summary `dflash demo` and `dflash run pipeline` end with, and the pipeline run's page shows:
each stage's flow run (state, duration, what it made, its page in the Prefect UI), the drafter's
acceptance length and speedup, and where every artifact lives (with its lineage page in the UI).

Stage runs are read from the Prefect server's REST API (plain HTTP: this package never imports
Prefect); the rest comes from the pipeline's return value. `read_stage_runs` does the I/O;
`summary` (rich tables, for a terminal) and `summary_markdown` (for the UI) only arrange what they
are given. The pipeline publishes its summary just before it returns, while the server still says it
is Running: `settle_pipeline` gives its own row the outcome it is about to end with. Times are UTC.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Any

from rich.console import Group
from rich.table import Table

from dflash_core.evaluate.match import match_label
from dflash_core.lineage_views import flow_run_url, node_label, node_of

# Which field of the pipeline's result (dflash_core.stage_results.PipelineResult) each stage's flow returned.
STAGE_RESULTS = {"generate": "generation", "tokenize": "tokenization", "train": "training", "evaluate": "evaluation",
                 "export": "export", "served": "served", "provision": "provision", "preserve": "preserve", "s3-audit": "audit"}
# Where the user looks after a run: Prefect's Retry cannot rerun a Completed run (our results are persisted, so
# the server refuses it while the UI still shows a success toast).
RERUN_ADVICE = ("To run a finished stage again, start a new run of the pipeline or of the stage's deployment: Retry "
                "in the UI reruns a Failed run in place, but on a Completed run the server refuses it (\"Run is "
                "already COMPLETED\") although the UI shows a success toast. In the new run, tokenization with "
                "refresh=true re-tokenizes every shard and generation with refresh=true checks every shard again (a "
                "new run name answers anew); training resumes from its latest checkpoint (raise max_steps, or change "
                "run_name to start over); evaluation and export cache nothing.")
_FLOW_RUN_LINK = re.compile(r"/runs/flow-run/([0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12})")


@dataclass(frozen=True)
class StageRun:
    """One flow run of a pipeline: the pipeline itself (depth 0) or a stage it started."""

    stage: str
    name: str
    id: str
    state: str
    seconds: float | None
    url: str | None
    depth: int = 0
    started: datetime | None = None  # when the flow run first started running (UTC)
    attempt: int = 1  # a Retry (or a flow's own retries) runs it again: 2, 3, ...
    attempt_started: datetime | None = None  # when its latest attempt started, for attempt > 1
    since_first_s: float | None = None  # for attempt > 1: from the first attempt's start to the end of the latest


def read_stage_runs(api_url: str, flow_run_id: str, *, timeout_s: float = 10.0) -> list[StageRun]:
    """The flow run and every flow run it started (stages, and theirs), depth first, in start order."""
    import httpx

    api = api_url.rstrip("/")
    with httpx.Client(timeout=timeout_s) as client:
        def post(path: str, body: dict) -> list[dict]:
            response = client.post(f"{api}{path}", json=body)
            response.raise_for_status()
            return response.json()

        root = client.get(f"{api}/flow_runs/{flow_run_id}")
        root.raise_for_status()
        runs: list[tuple[dict, int]] = []

        def visit(run: dict, depth: int) -> None:
            runs.append((run, depth))
            children = post("/flow_runs/filter", {"flow_runs": {"parent_flow_run_id": {"any_": [run["id"]]}},
                                                  "sort": "START_TIME_ASC"})
            for child in children:
                visit(child, depth + 1)

        visit(root.json(), 0)
        flows = post("/flows/filter", {"flows": {"id": {"any_": sorted({run["flow_id"] for run, _ in runs})}}})
        attempt_starts = {run["id"]: _latest_start(client, api, run["id"]) for run, _ in runs
                          if (run.get("run_count") or 0) > 1}
    flow_names = {flow["id"]: flow["name"] for flow in flows}
    return [_stage_run(run, depth, stage=flow_names.get(run["flow_id"], "?").removeprefix("dflash-"), api_url=api_url,
                       attempt_started=attempt_starts.get(run["id"]))
            for run, depth in runs]


def _latest_start(client, api: str, flow_run_id: str) -> datetime | None:
    """When the flow run last entered Running: its latest attempt's start."""
    response = client.get(f"{api}/flow_run_states/", params={"flow_run_id": flow_run_id})
    response.raise_for_status()
    return max((_time(state["timestamp"]) for state in response.json() if state.get("type") == "RUNNING"),
               default=None)


def _stage_run(run: dict, depth: int, *, stage: str, api_url: str, attempt_started: datetime | None) -> StageRun:
    """A flow run as the API lists it; a retried one timed by its latest attempt (Prefect's own total_run_time adds
    up every attempt's), with the time since its first attempt started."""
    started, ended = _time(run.get("start_time")), _time(run.get("end_time"))
    seconds, since_first_s = _seconds(run), None
    if attempt_started is not None:
        finished = ended is not None and ended >= attempt_started
        seconds = (ended - attempt_started).total_seconds() if finished else None
        since_first_s = (ended - started).total_seconds() if finished and started else None
    return StageRun(stage=stage, name=run["name"], id=run["id"], state=run.get("state_name") or "?", seconds=seconds,
                    url=flow_run_url(api_url, run["id"]), depth=depth, started=started,
                    attempt=max(run.get("run_count") or 1, 1), attempt_started=attempt_started,
                    since_first_s=since_first_s)


def settle_pipeline(stages: list[StageRun], *, state: str, now: datetime) -> list[StageRun]:
    """`stages` with the pipeline's own row (depth 0) as the run is about to end: `state` ("Completed" or
    "Failed") and the time since its latest attempt started (`now` - that start, both aware), and for a retried
    run since its first."""
    return [_settled(run, state=state, now=now) if run.depth == 0 else run for run in stages]


def _settled(run: StageRun, *, state: str, now: datetime) -> StageRun:
    attempt_started = run.attempt_started or run.started
    seconds = (now - attempt_started).total_seconds() if attempt_started else run.seconds
    since_first_s = (now - run.started).total_seconds() if run.attempt > 1 and run.started else run.since_first_s
    return replace(run, state=state, seconds=seconds, since_first_s=since_first_s)


def outcome_line(stages: list[StageRun]) -> str | None:
    """The pipeline's row as one line (`pipeline Completed after 3m 20s (started 2026-12-05 10:00:03 UTC)`; a
    retried run's latest attempt, then the time since the first started); None without one."""
    root = next((run for run in stages if run.depth == 0), None)
    if root is None:
        return None
    if root.attempt > 1 and root.attempt_started and root.started:
        return (f"pipeline {root.state} after {_duration(root.seconds)}, attempt {root.attempt} (started "
                f"{root.attempt_started:%Y-%m-%d %H:%M:%S} UTC; {_duration(root.since_first_s)} since the first "
                f"attempt started {root.started:%Y-%m-%d %H:%M:%S} UTC)")
    started = f" (started {root.started:%Y-%m-%d %H:%M:%S} UTC)" if root.started else ""
    return f"pipeline {root.state} after {_duration(root.seconds)}{started}"


def duration_cell(run: StageRun) -> str:
    """A row's duration: its latest attempt's; for a retried run also the attempt and the time since the first."""
    if run.attempt <= 1 or run.since_first_s is None:
        return _duration(run.seconds)
    return f"{_duration(run.seconds)} (attempt {run.attempt}; {_duration(run.since_first_s)} since the first)"


def _seconds(run: dict) -> float | None:
    if run.get("total_run_time"):
        return float(run["total_run_time"])
    if run.get("start_time") and run.get("end_time"):
        return (_time(run["end_time"]) - _time(run["start_time"])).total_seconds()
    return None


def _time(text: str | None) -> datetime | None:
    """An API timestamp as an aware UTC datetime."""
    return datetime.fromisoformat(text.replace("Z", "+00:00")).astimezone(UTC) if text else None


def parse_launch_output(lines: list[str]) -> tuple[str | None, dict | None]:
    """(flow run id, result) from what `python -m flows.launch` printed: the first flow-run link, and
    the JSON result it prints last (None for either when it is not there, e.g. after a failure)."""
    flow_run_id = next((m.group(1) for line in lines if (m := _FLOW_RUN_LINK.search(line))), None)
    starts = [i for i, line in enumerate(lines) if line.rstrip("\n") == "{"]
    result = None
    if starts:
        try:
            result = json.loads("".join(lines[starts[-1]:]))
        except ValueError:
            result = None
    return flow_run_id, result if isinstance(result, dict) else None


def summary(result: dict | None, stages: list[StageRun], *, title: str = "dflash pipeline") -> Group:
    """The tables: stages, the drafter's acceptance (and as the serving engine ran it, when it was served), artifacts."""
    result = result or {}
    served = served_table(result)
    return Group(stage_table(result, stages, title=title), drafter_table(result), *([served] if served else []),
                 artifact_table(result))


def stage_table(result: dict, stages: list[StageRun], *, title: str) -> Table:
    caption = "\n".join(line for line in (outcome_line(stages), RERUN_ADVICE) if line)
    table = Table(title=f"{title}: stages", title_justify="left", caption=caption, caption_justify="left")
    for column in ("stage", "state", "duration", "made", "flow run (Prefect UI)"):
        table.add_column(column, justify="right" if column == "duration" else "left", overflow="fold")
    for run in stages:
        state = {"Completed": f"[green]{run.state}[/]", "Cached": f"[green]{run.state}[/]"}.get(
            run.state, f"[red]{run.state}[/]" if run.state in ("Failed", "Crashed", "Cancelled") else run.state)
        label = ("  " * run.depth) + ("pipeline" if run.depth == 0 else run.stage)
        table.add_row(label, state, duration_cell(run), _made(run, result), f"{run.name}\n{run.url or ''}")
    if not stages:
        table.add_row("?", "?", "-", "the Prefect server did not list this run's stages", "")
    return table


SPLIT_LABELS = {"heldout": "on held-out prompts", "train": "IN-SAMPLE: on training prompts",
                "file": "on a prompt file"}


def generalization_line(evaluation: dict) -> str | None:
    """Held-out tau against the training tau (the evaluation's `generalization`), with the advice when the
    drafter memorized its data; None without one."""
    fit = evaluation.get("generalization")
    if not fit:
        return None
    passes = f" after {fit['data_passes']:.0f} passes over the data" if fit.get("data_passes") is not None else ""
    gap = fit.get("gap")
    ratio = f"{gap:.1f}x the held-out's" if gap is not None else "none accepted held out"
    line = (f"training tau {fit['train_tau']:.3f} vs held-out {fit['heldout_tau']:.3f}{passes} "
            f"(accepted drafts per round: {ratio})")
    return f"{line}: OVERFIT: {fit['advice']}" if fit.get("overfit") else line


def _matches(summary: dict) -> str:
    return match_label(summary) if "all_match_target" in summary else "-"


def served_table(result: dict) -> Table | None:
    """The served stage's rows, its engine's tau beside our evaluator's; None when the run served nothing."""
    served = _stage_result(result, "served")
    if not served.get("rows"):
        return None
    table = Table(title=f"drafter served by {served.get('engine', '?')}: engine tau "
                        f"{_number(served.get('tau'), '{:.3f}')}, our evaluator's "
                        f"{_number(served.get('evaluator_tau'), '{:.3f}')}", title_justify="left")
    for column in ("in flight", "target-only tokens/s", "with drafter tokens/s", "speedup", "engine tau",
                   "outputs equal"):
        table.add_column(column, justify="right")
    for r in served["rows"]:
        table.add_row(str(r.get("concurrency")), _number(r.get("target_tokens_per_s"), "{:,.0f}"),
                      _number(r.get("drafted_tokens_per_s"), "{:,.0f}"), _number(r.get("speedup"), "{:.2f}x"),
                      _number(r.get("tau"), "{:.3f}"), f"{r.get('outputs_equal_target')}/{r.get('prompts')}")
    return table


def drafter_table(result: dict) -> Table:
    evaluation = _stage_result(result, "evaluate")
    on = SPLIT_LABELS.get(evaluation.get("split"), "")
    table = Table(title="drafter: speculative decoding against the target" + (f", {on}" if on else ""),
                  title_justify="left", caption=generalization_line(evaluation), caption_justify="left")
    for column in ("mode", "responses", "tau (acceptance length)", "speedup", "tokens/s", "matches target"):
        table.add_column(column, justify="left" if column in ("mode", "matches target") else "right")
    for s in evaluation.get("summaries", []):
        table.add_row(str(s.get("mode")), str(s.get("num_responses", "-")), _number(s.get("tau"), "{:.3f}"),
                      _number(s.get("speedup"), "{:.2f}x"), _number(s.get("tokens_per_s"), "{:.1f}"),
                      _matches(s))
    if not table.row_count:
        table.add_row("-", "-", "-", "-", "-", "no evaluation in this run")
    return table


def artifact_table(result: dict) -> Table:
    """Each stored artifact, files of one directory (a checkpoint, an export) folded into one row."""
    table = Table(title="artifacts (each with a .manifest.json beside it)", title_justify="left")
    table.add_column("kind")
    table.add_column("where", overflow="fold")
    table.add_column("files", justify="right")
    groups: dict[tuple[str, str], list[dict]] = defaultdict(list)
    for record in _records(result):
        uri = record["uri"]
        folder = uri.rsplit("/", 1)[0] + "/"
        groups[(record.get("kind", "?"), folder if record.get("kind") in ("checkpoint", "export") else uri)].append(record)
    for (kind, where), records in groups.items():
        table.add_row(kind, where, str(len(records)))
    if not table.row_count:
        table.add_row("-", "nothing stored", "0")
    return table


def summary_markdown(result: dict | None, stages: list[StageRun], *, lineage: dict[str, str] | None = None,
                     title: str = "dflash pipeline", failure: str | None = None) -> str:
    """The same three tables in markdown, each artifact group linked to its lineage page (`lineage`: node ->
    page URL, nodes as dflash_core.lineage_views.node_of names them), under the pipeline's outcome (and
    `failure`, what ended it), and how to rerun a finished stage. A row's links come before its long cells (a long
    unbroken URI widens the table past the page), and a "made" cell names a long URI the artifacts section lists in
    full by its last segments."""
    result, lineage = result or {}, lineage or {}
    groups: dict[tuple[str, str], int] = defaultdict(int)
    for record in _records(result):
        groups[(record.get("kind", "?"), node_of(record["uri"], record.get("kind")))] += 1
    listed = {node for _, node in groups}
    outcome = outcome_line(stages)
    lines = [f"# {title}: stages", ""]
    lines += [f"**{outcome}**", ""] if outcome else []
    lines += [f"Why: {_cell(failure)}", ""] if failure else []
    lines += ["| stage | state | duration | flow run | made |", "|---|---|---:|---|---|"]
    for run in stages:
        label = ("↳ " * run.depth) + ("pipeline" if run.depth == 0 else run.stage)
        link = f"[{run.name}]({run.url})" if run.url else run.name
        made = _shortened_uris(_made(run, result), listed)
        lines.append(f"| {label} | {run.state} | {duration_cell(run)} | {link} | {_cell(made)} |")
    if not stages:
        lines.append("| ? | ? | - | the Prefect server did not list this run's stages | |")
    evaluation = _stage_result(result, "evaluate")
    on = SPLIT_LABELS.get(evaluation.get("split"), "")
    lines += ["", "## Drafter: speculative decoding against the target" + (f", {on}" if on else ""), "",
              "| mode | responses | tau (acceptance length) | speedup | tokens/s | matches target |",
              "|---|---:|---:|---:|---:|---|"]
    summaries = evaluation.get("summaries", [])
    lines += [f"| {s.get('mode')} | {s.get('num_responses', '-')} | {_number(s.get('tau'), '{:.3f}')} | "
              f"{_number(s.get('speedup'), '{:.2f}x')} | {_number(s.get('tokens_per_s'), '{:.1f}')} | "
              f"{_matches(s)} |" for s in summaries] \
        or ["| - | - | - | - | - | no evaluation in this run |"]
    fit = generalization_line(evaluation)
    lines += ["", fit] if fit else []
    lines += served_lines(_stage_result(result, "served"))
    lines += node_lines(_stage_result(result, "generate").get("by_node") or [])
    lines += ["", "## Artifacts (each with a .manifest.json beside it)", "", "| kind | files | lineage | where |",
              "|---|---:|---|---|"]
    for (kind, node), count in groups.items():
        page = lineage.get(node)
        lines.append(f"| {kind} | {count} | {f'[lineage of {node_label(node)}]({page})' if page else '-'} | `{node}` |")
    if not groups:
        lines.append("| - | 0 | | nothing stored |")
    lines += ["", "## Running a stage again", "", RERUN_ADVICE]
    return "\n".join(lines) + "\n"


def served_lines(served: dict) -> list[str]:
    """The drafter as the serving engine ran it (the served stage), beside our evaluator's tau; none without it."""
    if not served.get("rows"):
        return []
    lines = ["", f"## Served by {served.get('engine', '?')}: engine tau {_number(served.get('tau'), '{:.3f}')}, "
             f"our evaluator's {_number(served.get('evaluator_tau'), '{:.3f}')}", "",
             "| requests in flight | target-only tokens/s | with drafter tokens/s | speedup | engine tau | outputs equal |",
             "|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {r.get('concurrency')} | {_number(r.get('target_tokens_per_s'), '{:,.0f}')} | "
              f"{_number(r.get('drafted_tokens_per_s'), '{:,.0f}')} | {_number(r.get('speedup'), '{:.2f}x')} | "
              f"{_number(r.get('tau'), '{:.3f}')} | {r.get('outputs_equal_target')}/{r.get('prompts')} |"
              for r in served["rows"]]
    return lines


def node_lines(by_node: list[dict]) -> list[str]:
    """A generation across nodes, node by node (markdown): its shards, completions, tokens, and why it dropped out."""
    if not by_node:
        return []
    lines = ["", "## Generation, by node", "", "| node | shards | completions | failed | tokens generated now | runs | "
             "dropped out |", "|---|---:|---:|---:|---:|---:|---|"]
    for share in by_node:
        outcomes = share.get("outcomes") or {}
        lines.append(f"| {share['node']} | {len(share.get('shards', []))} | {outcomes.get('completed', 0):,} | "
                     f"{outcomes.get('failed', 0):,} | {outcomes.get('completion_tokens_now', 0):,} | "
                     f"{len(share.get('flow_runs', []))} | {_cell((share.get('lost') or '-')[:200])} |")
    return lines


MAX_CELL_URI_CHARS = 48  # a longer URI in a "made" cell is named by its last segments (the table stays on screen)
_URI = re.compile(r"\b(?:s3|file)://[^\s;,)]+")


def _shortened_uris(text: str, listed: set[str]) -> str:
    """`text` with each long URI that `listed` (the artifact section's nodes) holds in full, itself or a folder
    under it, written as `…/` and its last two segments; any other URI stays whole, so none is lost."""
    def short(match: re.Match) -> str:
        uri = match.group(0)
        folder = uri.rstrip("/") + "/"
        if len(uri) <= MAX_CELL_URI_CHARS or not any(node == uri or node.startswith(folder) for node in listed):
            return uri
        return "…/" + "/".join(uri.rstrip("/").split("/")[-2:])

    return _URI.sub(short, text)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _stage_result(result: dict, stage: str) -> dict:
    value = result.get(STAGE_RESULTS.get(stage, ""))
    return value if isinstance(value, dict) else {}


def _made(run: StageRun, result: dict) -> str:
    """One line on what a stage made, from its part of the pipeline's result."""
    if run.depth == 0:
        return f"plan report {result['report']}" if result.get("report") else ""
    if run.depth > 1:  # a stage's own runs: a generation across nodes' provisions and node shares
        share = next((s for s in _stage_result(result, "generate").get("by_node") or []
                      if run.id in s.get("flow_runs", [])), None) if run.stage == "generate" else None
        return f"node {share['node']}: {(share.get('completions_by_run') or {}).get(run.id, 0)} completions" \
            if share else ""
    part = _stage_result(result, run.stage)
    if not part:
        return ""
    if run.stage == "generate":
        shards = part.get("shards", [])
        heldout = sum(1 for s in shards if isinstance(s, dict) and s.get("split") == "heldout")
        outcomes = part.get("outcomes") or {}
        made = f"{len(shards)} shards ({heldout} held out)"
        nodes = part.get("by_node") or []
        across = f" on {len(nodes)} nodes (table below)" if nodes else ""
        if outcomes.get("completed") is None:
            return f"{made}, all generated before ({'no node needed' if nodes else 'no server started'})"
        return f"{outcomes['completed']} completions ({outcomes.get('failed', 0)} failed) in {made}{across}"
    if run.stage == "tokenize":
        samples = (part.get("overall") or {}).get("samples")
        return (f"{samples if samples is not None else '?'} samples in {len(part.get('train_shards', []))} training + "
                f"{len(part.get('heldout_shards', []))} held-out shards, quality gate {part.get('quality_gate', '?')}")
    if run.stage == "train":
        return f"checkpoint {part.get('uri')} (step {part.get('step', '?')}, {len(part.get('data', []))} shards)"
    if run.stage == "export":
        exports = part.get("exports") if isinstance(part.get("exports"), dict) else {}
        return "; ".join(f"{name} {uri}" for name, uri in exports.items())
    if run.stage == "provision":
        node = part.get("node")
        name = node.get("name") if isinstance(node, dict) else node
        where = f", model at {part['model']}" if part.get("model") else ""
        queue = f", stages on queue {part['work_queue']}" if part.get("work_queue") else ""
        return f"node {name}: {'; '.join(part.get('actions') or []) or 'already provisioned'}{where}{queue}"
    if run.stage == "preserve":
        return f"{len(part.get('saved', []))} objects under {part.get('prefix')}"
    if run.stage == "s3-audit":
        return f"{part.get('objects', '?')} objects, {part.get('dead_objects', '?')} dead; report {part.get('report')}"
    if run.stage == "served":
        rows = "; ".join(f"{r.get('concurrency')} in flight {_number(r.get('speedup'), '{:.2f}x')}"
                         for r in part.get("rows", []))
        return (f"{part.get('engine', '?')}: tau {_number(part.get('tau'), '{:.3f}')} (ours "
                f"{_number(part.get('evaluator_tau'), '{:.3f}')}), {rows}, outputs "
                f"{'equal' if part.get('all_outputs_equal') else 'NOT all equal'} to target-only")
    if run.stage == "evaluate":
        return f"on {part.get('split', '?')} prompts: " + "; ".join(
            f"{s.get('mode')}: tau {_number(s.get('tau'), '{:.3f}')}" for s in part.get("summaries", []))
    return ""


def _records(result: Any) -> list[dict]:
    """Every artifact record in the result, nested stages included, each URI once."""
    found: dict[str, dict] = {}

    def walk(value: Any) -> None:
        if isinstance(value, dict):
            for record in value.get("artifacts", []) if isinstance(value.get("artifacts"), list) else []:
                if isinstance(record, dict) and record.get("uri"):
                    found.setdefault(record["uri"], record)
            for child in value.values():
                walk(child)
        elif isinstance(value, list):
            for child in value:
                walk(child)

    walk(result)
    return list(found.values())


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    minutes, rest = divmod(round(seconds), 60)
    return f"{minutes}m {rest:02d}s" if minutes else f"{seconds:.1f}s"


def _number(value: Any, form: str) -> str:
    return form.format(value) if isinstance(value, (int, float)) else "-"
