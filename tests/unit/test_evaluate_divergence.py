"""Judging a speculative output that leaves the target's greedy output (`divergence.py`): a choice between
two tokens whose logits tie within a few ulps is a near-tie (what bf16 rounding does to a verify pass
against one-token steps), a token the target ranks clearly lower is a real divergence, and the report and
the run summary say which.

Run: .venv/bin/python -m pytest tests/unit/test_evaluate_divergence.py -q
"""

import pytest
import torch

from dflash_core.evaluate import Decoded, first_divergence, greedy_decode, match_label, summarize
from dflash_core.evaluate.divergence import TIE_ULPS, ulp
from dflash_core.evaluate.report import ResponseResult
from dflash_core.target import build_target, tiny_target_config

pytestmark = pytest.mark.usefixtures("one_thread")


def _target_with_a_tie(dtype):
    """A tiny target whose greedy token at new-token index 3 has a twin: another vocabulary row with the
    same LM-head weights, so the two logits are equal there, and greedy keeps the lower id."""
    torch.manual_seed(0)
    config = tiny_target_config("llama", num_layers=2)
    target = build_target(config).to(dtype)
    prompt = [5, 17, 42, 8, 99]
    greedy = greedy_decode(target, prompt, max_new_tokens=8).tokens
    chosen = greedy[3]
    twin = next(t for t in range(chosen + 1, config.vocab_size) if t not in prompt + greedy)
    with torch.no_grad():
        target.lm_head.weight[twin] = target.lm_head.weight[chosen]
    assert greedy_decode(target, prompt, max_new_tokens=8).tokens == greedy  # the twin never wins a tie
    return target, prompt, greedy, twin


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_choice_between_tied_logits_is_a_near_tie_and_a_worse_token_is_not(dtype):
    target, prompt, greedy, twin = _target_with_a_tie(dtype)
    assert first_divergence(target, prompt, greedy=greedy, decoded=list(greedy)) is None

    tie = first_divergence(target, prompt, greedy=greedy, decoded=greedy[:3] + [twin, 1, 2])
    assert tie.index == 3 and tie.margin == 0.0 and tie.near_tie

    with torch.no_grad():
        logits = target(input_ids=torch.tensor([prompt + greedy[:3]])).logits[0, -1]
    worst = int(logits.argmin())
    wrong = first_divergence(target, prompt, greedy=greedy, decoded=greedy[:3] + [worst])
    # the difference in Python floats, as the judge takes it: a bf16 subtraction would round it to 8 bits
    assert wrong.index == 3 and wrong.margin == pytest.approx(float(logits.max()) - float(logits[worst]))
    assert wrong.margin > wrong.tolerance and not wrong.near_tie
    assert wrong.tolerance == TIE_ULPS * ulp(float(logits.max()), dtype)

    cut_short = first_divergence(target, prompt, greedy=greedy, decoded=greedy[:5])
    assert cut_short.index == 5 and cut_short.margin is None and not cut_short.near_tie


def test_ulp_is_the_spacing_of_the_dtype_at_the_value():
    assert ulp(18.6, torch.bfloat16) == 0.125  # bf16 between 16 and 32: 8 bits of mantissa precision
    assert ulp(6.3, torch.bfloat16) == 2.0 ** -5
    assert ulp(0.01, torch.bfloat16) == 2.0 ** -7  # below 1: the spacing at 1
    assert ulp(18.6, torch.float32) == 2.0 ** -19


def test_the_summary_counts_exact_outputs_near_ties_and_real_divergences():
    target, prompt, greedy, twin = _target_with_a_tie(torch.float32)

    def result(decoded_tokens):
        return ResponseResult(prompt_index=0, prompt_tokens=len(prompt), baseline_wall_s=1.0,
                              decoded=Decoded(tokens=decoded_tokens, accepted=[0] * (len(decoded_tokens) - 1),
                                              wall_s=1.0, num_target_forwards=len(decoded_tokens)),
                              matches_target=decoded_tokens == greedy,
                              divergence=first_divergence(target, prompt, greedy=greedy, decoded=decoded_tokens))

    exact, tie = result(list(greedy)), result(greedy[:3] + [twin] + greedy[4:])
    summary = summarize([exact, tie, exact], block_size=4, mode="block")
    assert (summary["exact_matches"], summary["near_ties"], summary["divergences"]) == (2, 1, 0)
    assert not summary["all_match_target"] and match_label(summary) == "2/3 exact, 1 near-ties"
    assert summary["responses"][1]["divergence"] == {"index": 3, "margin": 0.0, "tolerance": tie.divergence.tolerance,
                                                     "near_tie": True}
    worst = result(greedy[:3] + [0] * 5)
    summary = summarize([exact, tie, worst], block_size=4, mode="block")
    assert summary["divergences"] == 1 and match_label(summary).startswith("NO: 1 diverged (1/3 exact, 1 near-ties")
    assert match_label(summarize([exact], block_size=4, mode="block")) == "yes"
    assert match_label({"all_match_target": False}) == "False"  # a report from before divergences were judged
