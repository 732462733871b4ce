"""Dataset statistics of tokenized shards (polars): per shard, per source dataset, overall.

Inputs are light frames: `sample_frame` keeps a shard table's scalar columns (no token lists),
`skipped_frame` turns a shard's quarantine into rows. `summarize` aggregates either by any key;
`stats_rows`/`stats_markdown` format a summary for a Prefect table/markdown artifact and
`histogram_png` draws the loss-tokens-per-sample histogram the field's failures show up in.
"""

from __future__ import annotations

import io

import polars as pl
import pyarrow as pa

from dflash_core.tokenize.shard import DUPLICATE_ID, FLAG_COLUMNS, QuarantineLine

SHORT_LOSS_TOKENS = 8
ALL = "all"
# Histogram bin edges of loss tokens per sample: 0, 1-2, 3-4, 5-8, ... (powers of two).
HISTOGRAM_EDGES = [0, 1, 3, 5, 9, 17, 33, 65, 129, 257, 513, 1025, 2049, 4097, 8193, 16385, 32769]


def sample_frame(table: pa.Table, *, shard: str) -> pl.DataFrame:
    """A shard table's per-sample scalars (id, source, lengths, flags) with its shard name."""
    light = table.drop_columns([c for c in ("input_ids", "loss_mask") if c in table.column_names])
    return pl.from_arrow(light).with_columns(pl.lit(shard).alias("shard"))


def skipped_frame(quarantine: list[QuarantineLine], *, shard: str, blank_lines: int = 0) -> pl.DataFrame:
    """One row per line that is not in the table: shard, source (None if unparsed), reason."""
    rows = [{"shard": shard, "source": q.source, "reason": q.reason} for q in quarantine]
    rows += [{"shard": shard, "source": None, "reason": "blank_line"}] * blank_lines
    return pl.DataFrame(rows, schema={"shard": pl.String, "source": pl.String, "reason": pl.String})


def summarize(samples: pl.DataFrame, skipped: pl.DataFrame, *, by: str | None = None,
              short_loss_tokens: int = SHORT_LOSS_TOKENS) -> pl.DataFrame:
    """One row per value of `by` ("shard", "source"), or one row "all" when by is None.

    `duplicate_ids` counts the samples whose id repeats another sample's plus the lines quarantined as
    `duplicate_id`; those lines are not in `skipped`, so one duplicate fails one gate check.
    """
    key = by or "group"
    if by is None:
        samples = samples.with_columns(pl.lit(ALL).alias(key))
        skipped = skipped.with_columns(pl.lit(ALL).alias(key))
    length, loss = pl.col("num_tokens").cast(pl.Int64), pl.col("num_loss_tokens").cast(pl.Int64)
    kept = samples.group_by(key).agg(
        pl.len().alias("samples"),
        length.sum().alias("total_tokens"),
        loss.sum().alias("loss_tokens"),
        length.mean().alias("mean_len"),
        length.median().alias("median_len"),
        length.quantile(0.9, interpolation="nearest").alias("p90_len"),
        length.max().alias("max_len"),
        (loss <= short_loss_tokens).sum().alias("short_loss"),
        *[pl.col(flag).sum().alias(flag) for flag in FLAG_COLUMNS],
        (pl.len() - pl.col("id").n_unique()).alias("duplicate_ids"),
    )
    duplicate = pl.col("reason") == DUPLICATE_ID
    skips = skipped.filter(pl.col(key).is_not_null()).group_by(key).agg(
        (~duplicate).sum().alias("skipped"), duplicate.sum().alias("quarantined_duplicates"))
    summary = kept.join(skips, on=key, how="full", coalesce=True).with_columns(
        pl.col("samples", "total_tokens", "loss_tokens", "short_loss", "duplicate_ids", *FLAG_COLUMNS,
               "skipped", "quarantined_duplicates").fill_null(0),
    )
    summary = summary.with_columns(
        (pl.col("duplicate_ids") + pl.col("quarantined_duplicates")).alias("duplicate_ids"),
    ).drop("quarantined_duplicates")
    summary = summary.with_columns(
        (pl.col("loss_tokens") / pl.col("total_tokens")).fill_nan(0.0).alias("loss_ratio"),
    )
    return summary.sort(key).rename({"group": "dataset"} if by is None else {})


def skip_reasons(skipped: pl.DataFrame) -> dict[str, int]:
    counts = skipped.group_by("reason").len().sort("reason")
    return dict(zip(counts["reason"].to_list(), counts["len"].to_list()))


def loss_histogram(samples: pl.DataFrame) -> list[dict]:
    """Samples per loss-token bin: [{"bin": "5-8", "low": 5, "high": 8, "samples": n}, ...]."""
    loss = samples["num_loss_tokens"].to_numpy()
    rows = []
    edges = [*HISTOGRAM_EDGES, max(HISTOGRAM_EDGES[-1], int(loss.max(initial=0)) + 1)]
    for low, high in zip(edges[:-1], edges[1:]):
        count = int(((loss >= low) & (loss < high)).sum())
        label = str(low) if high - low == 1 else f"{low}-{high - 1}"
        rows.append({"bin": label, "low": low, "high": high - 1, "samples": count})
    while len(rows) > 1 and rows[-1]["samples"] == 0:
        rows.pop()
    return rows


def histogram_png(samples: pl.DataFrame, *, title: str = "loss tokens per sample") -> bytes:
    """A bar chart of `loss_histogram`, one bar series per source dataset, as PNG bytes."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    sources = sorted(samples["source"].unique().to_list()) if samples.height else []
    bins = loss_histogram(samples)
    figure = Figure(figsize=(9, 4.5), dpi=100)
    axes = figure.subplots()
    width = 0.8 / max(1, len(sources))
    for index, source in enumerate(sources):
        counts = [row["samples"] for row in loss_histogram(samples.filter(pl.col("source") == source))]
        counts += [0] * (len(bins) - len(counts))
        axes.bar([i + index * width for i in range(len(bins))], counts[:len(bins)], width=width, label=source)
    axes.set_xticks([i + 0.4 - width / 2 for i in range(len(bins))], [row["bin"] for row in bins], rotation=45)
    axes.set_xlabel("loss tokens per sample")
    axes.set_ylabel("samples")
    axes.set_title(title)
    if sources:
        axes.legend(fontsize="small")
    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    return buffer.getvalue()


# The columns the quality gate reads come first, so a narrow view (the UI's table) shows them.
GATE_COLUMNS = ("samples", "skipped", "short_loss", "boilerplate_only", "empty_reasoning", "degenerate_repetition",
                "degenerate_tool_calls", "truncated", "duplicate_ids")
SIZE_COLUMNS = ("samples", "total_tokens", "loss_tokens", "loss_ratio", "mean_len", "median_len", "p90_len", "max_len")
_TABLE_COLUMNS = (*GATE_COLUMNS, *SIZE_COLUMNS[1:])


def stats_rows(summary: pl.DataFrame, columns: tuple[str, ...] = _TABLE_COLUMNS) -> list[dict]:
    """Summary rows as plain dicts (the key column, then `columns`), floats rounded, for a table artifact."""
    key = summary.columns[0]
    rows = []
    for row in summary.iter_rows(named=True):
        out = {key: row[key]}
        for column in columns:
            value = row.get(column)
            out[column] = round(value, 3) if isinstance(value, float) else value
        rows.append(out)
    return rows


def stats_markdown(summary: pl.DataFrame) -> str:
    """Two markdown tables, the gate's counts and the sizes, each narrow enough to read in the UI."""
    if not summary.height:
        return "(no samples)"
    return (f"Quality-gate counts\n\n{_markdown_table(stats_rows(summary, GATE_COLUMNS))}\n\n"
            f"Sizes (tokens)\n\n{_markdown_table(stats_rows(summary, SIZE_COLUMNS))}")


def _markdown_table(rows: list[dict]) -> str:
    header = list(rows[0])
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join("" if row[c] is None else str(row[c]) for c in header) + " |" for row in rows]
    return "\n".join(lines)
