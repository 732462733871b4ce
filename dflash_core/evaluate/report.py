"""Acceptance statistics of speculative decoding runs: tau, its histogram, per-position acceptance,
speedup and tokens/s, plus the markdown table and PNG the evaluate flow publishes.

tau: per round, accepted drafted tokens + 1 (the tokens the round added: a last round cut short by
max_new_tokens or an EOS counts only what was kept, `Decoded.accepted`); averaged per response, then
over responses. tau_pooled: the same over every round of every response at once, as a serving engine's
counters pool them (vLLM's accepted / drafts + 1). Per-position acceptance (acc@k): for draft position k (1..B-1), the fraction of
rounds that accepted at least k drafted tokens. Speedup: target-only wall time over speculative wall
time, summed over the same responses in the same harness (both include prefill).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from dflash_core.evaluate.divergence import Divergence
from dflash_core.evaluate.match import match_label
from dflash_core.evaluate.speculative import Decoded


@dataclasses.dataclass
class ResponseResult:
    prompt_index: int
    prompt_tokens: int
    decoded: Decoded
    baseline_wall_s: float
    matches_target: bool
    divergence: Divergence | None = None  # where a response that does not match leaves the greedy output


def summarize(results: list[ResponseResult], *, block_size: int, mode: str) -> dict[str, Any]:
    """Overall and per-response statistics of one mode over a set of responses."""
    if not results:
        raise ValueError("no responses to summarize")
    rounds = [a for r in results for a in r.decoded.accepted]
    taus = [r.decoded.tau for r in results if r.decoded.accepted]
    histogram = {str(t): 0 for t in range(1, block_size + 1)}
    for accepted in rounds:
        histogram[str(accepted + 1)] += 1
    per_position = [sum(a >= k for a in rounds) / len(rounds) if rounds else 0.0 for k in range(1, block_size)]
    spec_s = sum(r.decoded.wall_s for r in results)
    base_s = sum(r.baseline_wall_s for r in results)
    tokens = sum(len(r.decoded.tokens) for r in results)
    per_round_ms = 1000 / len(rounds) if rounds else 0.0
    draft_s, verify_s = sum(r.decoded.draft_s for r in results), sum(r.decoded.verify_s for r in results)
    return {
        "mode": mode,
        "num_responses": len(results),
        "num_rounds": len(rounds),
        "tau": sum(taus) / len(taus) if taus else 0.0,
        "tau_pooled": 1 + sum(rounds) / len(rounds) if rounds else 0.0,
        "tau_histogram": histogram,
        "acceptance_per_position": per_position,
        "speedup": base_s / spec_s if spec_s > 0 else 0.0,
        "tokens_per_s": tokens / spec_s if spec_s > 0 else 0.0,
        "baseline_tokens_per_s": tokens / base_s if base_s > 0 else 0.0,
        "new_tokens": tokens,
        "target_forwards": sum(r.decoded.num_target_forwards for r in results),
        "all_match_target": all(r.matches_target for r in results),
        "exact_matches": sum(r.matches_target for r in results),
        "near_ties": sum(r.divergence is not None and r.divergence.near_tie for r in results),
        "divergences": sum(not r.matches_target and not (r.divergence and r.divergence.near_tie)
                           for r in results),
        # A round's wall time split (ms): drafting, verifying, the rest (cache updates, host work); beside what one
        # target-only step costs, which a round must beat by tau to speed decoding up.
        "round_ms": {"draft": draft_s * per_round_ms, "verify": verify_s * per_round_ms,
                     "other": max(spec_s - draft_s - verify_s, 0.0) * per_round_ms,
                     "target_step": 1000 * base_s / tokens if tokens else 0.0},  # one forward per new token
        "responses": [
            {"prompt_index": r.prompt_index, "prompt_tokens": r.prompt_tokens, "new_tokens": len(r.decoded.tokens),
             "tau": r.decoded.tau, "accepted_per_round": r.decoded.accepted, "wall_s": r.decoded.wall_s,
             "baseline_wall_s": r.baseline_wall_s, "matches_target": r.matches_target,
             "divergence": r.divergence.as_dict() if r.divergence else None}
            for r in results
        ],
    }


def markdown_table(summaries: list[dict[str, Any]]) -> str:
    lines = [
        "| mode | harness | responses | rounds | tau | speedup | tokens/s | target-only tokens/s | matches target "
        "| round ms: draft / verify / other | target-only step ms |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|---|---:|",
    ]
    for s in summaries:
        split = s.get("round_ms") or {}
        lines.append(
            f"| {s['mode']} | {s.get('harness', 'eager')} | {s['num_responses']} | {s['num_rounds']} | "
            f"{s['tau']:.3f} | {s['speedup']:.2f}x | "
            f"{s['tokens_per_s']:.1f} | {s['baseline_tokens_per_s']:.1f} | {match_label(s)} | "
            f"{split.get('draft', 0):.2f} / {split.get('verify', 0):.2f} / {split.get('other', 0):.2f} | "
            f"{split.get('target_step', 0):.2f} |"
        )
    return "\n".join(lines)


def plot_acceptance(summaries: list[dict[str, Any]], path: Path) -> Path:
    """PNG: tau histogram (per round) and per-position acceptance, one series per mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    width = 0.8 / max(len(summaries), 1)
    for index, s in enumerate(summaries):
        keys = sorted(s["tau_histogram"], key=int)
        total = max(sum(s["tau_histogram"].values()), 1)
        left.bar([int(k) + index * width for k in keys], [s["tau_histogram"][k] / total for k in keys],
                 width=width, label=f"{s['mode']} (tau {s['tau']:.2f})")
        positions = range(1, len(s["acceptance_per_position"]) + 1)
        right.plot(list(positions), s["acceptance_per_position"], marker="o", label=s["mode"])
    left.set(title="tau per round", xlabel="accepted + 1", ylabel="fraction of rounds")
    right.set(title="acceptance per draft position", xlabel="draft position", ylabel="P(accepted >= k)", ylim=(0, 1.05))
    left.legend()
    right.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return Path(path)
