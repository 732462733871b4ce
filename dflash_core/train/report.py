"""Training curves for people: metrics.jsonl -> summary rows and a PNG of loss and acceptance length,
from the window means each record carries (one step's metrics are noisy)."""

from __future__ import annotations

import io
import json
import warnings
from dataclasses import dataclass
from pathlib import Path

from dflash_core.storage.disk import RUN_DISK_FULL_ADVICE, write_atomically


@dataclass(frozen=True)
class MetricsLog:
    records: list[dict]  # by step; a step logged twice (before a crash and after resume) keeps the last
    skipped_lines: list[int]  # 1-based numbers of torn or malformed lines
    path: Path

    def skipped_message(self) -> str:
        shown = ", ".join(map(str, self.skipped_lines[:10])) + (", ..." if len(self.skipped_lines) > 10 else "")
        return (f"{self.path}: skipped {len(self.skipped_lines)} torn or malformed line(s) (line {shown}); a record "
                "cut short by a crash mid-write is logged again after the resume")


def load_metrics(path: Path) -> MetricsLog:
    """metrics.jsonl's records, skipping lines that are not a record: a write cut short by a crash (or
    one still being written) or anything else malformed. A record a resumed run glued onto a torn line
    (logs written before resumed runs cut the log, `trim_metrics`) is recovered from that line."""
    by_step: dict[int, dict] = {}
    skipped = []
    for number, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if not line.strip():
            continue
        if _record(line) is None:
            skipped.append(number)
        record = _recovered(line)
        if record is not None:
            by_step[record["step"]] = record
    return MetricsLog(records=[by_step[step] for step in sorted(by_step)], skipped_lines=skipped, path=Path(path))


def _recovered(line: str) -> dict | None:
    """The line's record, or the one glued onto the end of a torn line."""
    record = _record(line)
    if record is None and (glued := line.rfind('{"step"')) > 0:
        record = _record(line[glued:])
    return record


def _record(text: str) -> dict | None:
    try:
        record = json.loads(text)
    except ValueError:
        return None
    step = record.get("step") if isinstance(record, dict) else None
    return record if isinstance(step, int) and not isinstance(step, bool) else None


def read_metrics(path: Path) -> list[dict]:
    """load_metrics' records; skipped lines are named in a warning."""
    metrics = load_metrics(path)
    if metrics.skipped_lines:
        warnings.warn(metrics.skipped_message(), stacklevel=2)
    return metrics.records


def trim_metrics(path: Path, *, step: int) -> int:
    """Cut metrics.jsonl after its last record of `step` or earlier: a run resumed at `step` (0: started over)
    logs the steps after it again, and a crash mid-write leaves a torn line there. The lines before stay as
    they are; the number of lines cut. Written to a temp file and renamed, so a crash keeps one whole log."""
    try:
        lines = path.read_bytes().splitlines(keepends=True)
    except FileNotFoundError:
        return 0
    kept = 0
    for number, line in enumerate(lines, start=1):
        record = _recovered(line.decode("utf-8", errors="replace"))
        if record is not None and record["step"] <= step:
            kept = number
    data = b"".join(lines[:kept])
    if kept == len(lines) and data.endswith(b"\n") or not lines:
        return 0
    write_atomically(path, data if not data or data.endswith(b"\n") else data + b"\n",
                     what=f"{path.name} cut after step {step}", advice=RUN_DISK_FULL_ADVICE)
    return len(lines) - kept


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
