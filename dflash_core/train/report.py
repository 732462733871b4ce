"""Training curves for people: metrics.jsonl -> summary rows and a PNG of loss and acceptance length,
from the window means each record carries (one step's metrics are noisy)."""

from __future__ import annotations

import io
import json
import os
import warnings
from pathlib import Path


def read_metrics(path: Path) -> list[dict]:
    """Logged records by step; a step logged twice (before a crash and after resume) keeps the last.
    A torn line (a write cut short by a crash, or one still being written) is skipped with a warning
    that names it: its step is logged again after the resume."""
    by_step: dict[int, dict] = {}
    torn = []
    for number, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            by_step[int(record["step"])] = record
        except (ValueError, TypeError, KeyError):
            torn.append(number)
    if torn:
        warnings.warn(f"{path}: skipped {len(torn)} torn or malformed line(s) (line {', '.join(map(str, torn[:10]))}): "
                      "a record cut short by a crash is logged again after the resume", stacklevel=2)
    return [by_step[step] for step in sorted(by_step)]


def end_torn_line(path: Path) -> bool:
    """A crash mid-write leaves the last record without its newline: end that line, so the next record
    starts one of its own (read_metrics skips the torn one). True when there was one."""
    try:
        with open(path, "rb+") as handle:
            if handle.seek(0, os.SEEK_END) == 0:
                return False
            handle.seek(-1, os.SEEK_END)
            if handle.read(1) == b"\n":
                return False
            handle.write(b"\n")
            return True
    except FileNotFoundError:
        return False


def smoothed(record: dict) -> dict:
    """The record's metrics averaged over its logging window where it has one (runs logged before
    windows existed keep their last-step values)."""
    window = record.get("window") or {}
    return {**record, **{name: value for name, value in window.items() if name != "steps"}}


def summary_rows(records: list[dict], *, every: int = 1) -> list[dict]:
    """Rows for a table, one per `every` records plus the last; metrics are window means."""
    rows = []
    for record in records[::every] + ([records[-1]] if records and (len(records) - 1) % every else []):
        record = smoothed(record)
        accuracy = record.get("accuracy_per_position") or []
        rows.append({"step": record["step"], "loss": round(record["loss"], 4),
                     "tau": round(record["acceptance_length"], 3),
                     "acc@1": round(accuracy[0], 3) if accuracy else None,
                     "lr": f"{record['lr']:.2e}", "tokens/s": round(record.get("tokens_per_s", 0))})
    return rows


def curves_png(records: list[dict], *, title: str) -> bytes:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = [smoothed(r) for r in records]
    steps = [r["step"] for r in records]
    figure, (loss_axis, tau_axis) = plt.subplots(1, 2, figsize=(10, 3.6))
    loss_axis.plot(steps, [r["loss"] for r in records])
    loss_axis.set(title="loss", xlabel="step")
    tau_axis.plot(steps, [r["acceptance_length"] for r in records], label="tau (product of accuracies)")
    if records and "acceptance_length_empirical" in records[0]:
        tau_axis.plot(steps, [r["acceptance_length_empirical"] for r in records], label="tau (greedy runs)")
    tau_axis.set(title="expected acceptance length", xlabel="step")
    tau_axis.legend(fontsize=8)
    figure.suptitle(title)
    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=110)
    plt.close(figure)
    return buffer.getvalue()
