"""The tokenize flow's report: one log line per shard, and the stats table, markdown and loss histogram as
Prefect artifacts."""

from __future__ import annotations

import json

import polars as pl
from prefect.artifacts import create_markdown_artifact, create_table_artifact

from dflash_core.tokenize import GateProblem, stats_markdown, stats_rows
from dflash_core.tokenize.stats import skip_reasons
from tasks.artifacts import ui_key
from tasks.store import png_artifact
from tasks.tokenize import ShardSummary


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


def publish_stats(*, override: bool, name: str, by_shard, by_source, overall, skipped, problems,
                   verdict: str, png: bytes) -> None:
    """Table, markdown and histogram artifacts, keyed by dataset/run so one run's never replaces another's."""
    create_table_artifact(stats_rows(pl.concat([by_source.rename({"source": "dataset"}), overall])),
                          key=ui_key("tokenize-stats", name),
                          description=f"{name}: per dataset and overall")
    overridden = " (overridden: the run finished, training still refuses it)" if problems and override else ""
    create_markdown_artifact(
        f"## Tokenized {name}\n\n### Quality gate: {verdict}{overridden}\n"
        + ("\n".join(f"- {p.message}" for p in problems) or "every check passed")
        + f"\n\n### Per dataset\n{stats_markdown(by_source)}\n\n### Overall\n{stats_markdown(overall)}\n\n"
        f"### Per shard\n{stats_markdown(by_shard)}\n\n### Skipped lines\n{json.dumps(skip_reasons(skipped))}\n",
        key=ui_key("tokenize-report", name))
    png_artifact(png, key=ui_key("tokenize-loss-histogram", name),
                 description=f"{name}: loss tokens per sample, per source dataset")
