"""The evaluator's verdict on its outputs in a few words, for tables (no torch: the run summary uses it)."""

from __future__ import annotations

from typing import Any


def match_label(summary: dict[str, Any]) -> str:
    """How the speculative outputs compare with greedy decoding, in a few words: `yes` (all equal), the exact
    count and the bf16 near-ties, or NO with the real divergences (a bug)."""
    if summary["all_match_target"]:
        return "yes"
    if "near_ties" not in summary:  # a report written before divergences were judged
        return str(summary["all_match_target"])
    counts = f"{summary['exact_matches']}/{summary['num_responses']} exact, {summary['near_ties']} near-ties"
    return f"NO: {summary['divergences']} diverged ({counts})" if summary["divergences"] else counts
