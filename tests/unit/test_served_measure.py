"""Reading a serving engine's spec-decode counters and comparing a drafted pass with a target-only pass
(dflash_core/evaluate/served.py).

Run: .venv/bin/python -m pytest -q -n 0 tests/unit/test_served_measure.py
"""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Counter, generate_latest

from dflash_core.evaluate.served import ConcurrencyPass, SpecCounters, compare_served, parse_spec_counters


def _vllm_exposition(*, drafts: int, accepted: int, per_position: list[int], engines: int = 1) -> str:
    """The counters as vLLM's own prometheus_client objects expose them (vllm/v1/spec_decode/metrics.py):
    one child per engine, per-position counts labelled by position."""
    registry = CollectorRegistry()
    labels = ["model_name", "engine"]
    made = {name: Counter(name, "doc", labels, registry=registry) for name in (
        "vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens", "vllm:spec_decode_num_accepted_tokens")}
    per_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos", "doc", [*labels, "position"], registry=registry)
    for engine in range(engines):
        made["vllm:spec_decode_num_drafts"].labels("m", str(engine)).inc(drafts)
        made["vllm:spec_decode_num_draft_tokens"].labels("m", str(engine)).inc(drafts * len(per_position))
        made["vllm:spec_decode_num_accepted_tokens"].labels("m", str(engine)).inc(accepted)
        for position, count in enumerate(per_position):
            per_pos.labels("m", str(engine), str(position)).inc(count)
    Counter("vllm:generation_tokens", "doc", registry=registry).inc(999)  # other families are ignored
    return generate_latest(registry).decode()


def test_counters_are_summed_over_engines_and_positions_kept_in_order():
    counters = parse_spec_counters(_vllm_exposition(drafts=10, accepted=25, per_position=[9, 7, 5, 3, 1, 0, 0],
                                                    engines=2))
    assert counters.drafts == 20 and counters.accepted == 50 and counters.draft_tokens == 140
    assert counters.accepted_per_position == (18, 14, 10, 6, 2, 0, 0)
    assert counters.tau == pytest.approx(3.5)  # accepted + 1 per round, as our evaluator counts
    assert counters.acceptance_per_position[:2] == [0.9, 0.7]


def test_a_target_only_server_has_no_rounds():
    assert parse_spec_counters("# no spec decode here\n").tau is None


def test_a_pass_is_measured_between_two_readings():
    before = parse_spec_counters(_vllm_exposition(drafts=4, accepted=6, per_position=[3, 2, 1]))
    after = parse_spec_counters(_vllm_exposition(drafts=14, accepted=26, per_position=[10, 9, 7]))
    delta = after - before
    assert (delta.drafts, delta.accepted, delta.accepted_per_position) == (10, 20, (7, 7, 6))


def _pass(concurrency: int, outputs: list[list[int]], wall_s: float, counters: SpecCounters = SpecCounters()):
    return ConcurrencyPass(concurrency=concurrency, wall_s=wall_s, output_tokens=sum(map(len, outputs)),
                           counters=counters, outputs=outputs)


def test_the_served_table_counts_outputs_that_differ_from_the_target():
    target = [[1, 2, 3], [4, 5, 6]]
    drafted = [[1, 2, 3], [4, 5, 7]]
    rounds = SpecCounters(drafts=2, accepted=3, accepted_per_position=(2, 1))
    served = compare_served([_pass(1, target, 2.0), _pass(8, target, 1.0)],
                            [_pass(1, target, 1.0, rounds), _pass(8, drafted, 0.5, rounds)])
    assert [row["speedup"] for row in served["rows"]] == [2.0, 2.0]
    assert [row["outputs_equal_target"] for row in served["rows"]] == [2, 1]
    assert not served["all_outputs_equal"]
    assert served["tau"] == pytest.approx(2.5) and served["acceptance_per_position"] == [1.0, 0.5]
    with pytest.raises(ValueError, match="different concurrencies"):
        compare_served([_pass(1, target, 1.0)], [_pass(8, target, 1.0)])


def test_vllm_0_26s_own_exposition_reads_as_rounds_with_nothing_accepted():
    """/metrics of vLLM 0.26.0 on an H100 (2026-12-06) after serving a random-weight SmolLM2-shaped target with a
    random DFlash export (block 8, 7 speculative tokens): every round drafted, none accepted."""
    text = (Path(__file__).resolve().parents[1] / "data" / "vllm-0.26.0-metrics-dflash.txt").read_text()
    counters = parse_spec_counters(text)
    assert counters.drafts == 6126 and counters.draft_tokens == 6126 * 7
    assert counters.accepted == 0 and counters.accepted_per_position == (0,) * 7
    assert counters.tau == 1.0


def test_our_evaluators_pooled_tau_counts_rounds_as_the_engine_does():
    """tau averages per response first; tau_pooled sums every round first, as vLLM's counters do."""
    from dflash_core.evaluate.report import ResponseResult, summarize
    from dflash_core.evaluate.speculative import Decoded

    def response(accepted: list[int]) -> ResponseResult:
        decoded = Decoded(tokens=[1] * (len(accepted) + sum(accepted)), accepted=accepted, wall_s=1.0,
                          num_target_forwards=len(accepted))
        return ResponseResult(prompt_index=0, prompt_tokens=3, baseline_wall_s=1.0, decoded=decoded,
                              matches_target=True, divergence=None)

    summary = summarize([response([3]), response([0, 0, 0])], block_size=4, mode="block")
    assert summary["tau"] == pytest.approx((4 + 1) / 2)
    assert summary["tau_pooled"] == pytest.approx(1 + 3 / 4)
