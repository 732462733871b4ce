"""The fixed-shape decoding harness (`graphed.py`): on CPU its steps run without graphs, and every
token, every round's accepted length and the stop rules must equal the eager harness's, with a
random drafter (rejections), an oracle (every acceptance length) and a drafter that learned the
target (long acceptances). On a GPU the same steps are CUDA graphs (tests/gpu/test_evaluate_gpu.py).

Run: .venv/bin/python -m pytest tests/unit/test_evaluate_graphed.py -q
"""

import pytest

from dflash_core.evaluate import GraphedDecoder, SpeculativeDecoder, evaluate_prompts, greedy_decode, pick_harness
from tests.unit.test_evaluate_speculative import _BLOCK, _NEW, _OracleDrafter, _overfit, _selector_drafter, _setup

pytestmark = pytest.mark.usefixtures("one_thread")


def _same_as_eager(target, drafter, prompts, *, eos=None, max_new=_NEW):
    graphed = GraphedDecoder(target=target, drafter=drafter, capacity=96)
    eager = SpeculativeDecoder(target=target, drafter=drafter)
    for prompt in prompts:
        reference = greedy_decode(target, prompt, max_new_tokens=max_new, eos_token_id=eos)
        assert graphed.greedy(prompt, max_new_tokens=max_new, eos_token_id=eos).tokens == reference.tokens
        want = eager.generate(prompt, max_new_tokens=max_new, eos_token_id=eos)
        got = graphed.generate(prompt, max_new_tokens=max_new, eos_token_id=eos)
        assert got.tokens == want.tokens == reference.tokens
        assert got.accepted == want.accepted and got.num_target_forwards == want.num_target_forwards
    return got


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_random_and_oracle_drafters_decode_exactly_as_the_eager_harness(family):
    target, drafter, prompts = _setup(family)
    _same_as_eager(target, drafter, prompts)
    reference = greedy_decode(target, prompts[0], max_new_tokens=_NEW).tokens
    oracle = _OracleDrafter(drafter, prompts[0] + reference, wrong_every=3)
    decoded = _same_as_eager(target, oracle, prompts[:1])
    assert len(set(decoded.accepted[:-1])) >= 2  # rejections and acceptances of several lengths


def test_stop_rules_and_a_reused_decoder_match_the_eager_harness():
    target, drafter, prompts = _setup("qwen3")
    reference = greedy_decode(target, prompts[0], max_new_tokens=_NEW).tokens
    oracle = _OracleDrafter(drafter, prompts[0] + reference, wrong_every=1000)
    eos = next(t for j, t in enumerate(reference[1:], 1) if t not in reference[:j] and (j - 1) % _BLOCK < _BLOCK - 1)
    decoded = _same_as_eager(target, oracle, prompts[:1], eos=eos)
    assert decoded.tokens[-1] == eos
    for max_new in (1, 3, 1 + _BLOCK, 3 + _BLOCK):  # the last round counts only what fits
        _same_as_eager(target, oracle, prompts[:1], max_new=max_new)


def test_a_learned_drafter_and_a_dflash2_selector_reach_the_same_tau_in_both_harnesses():
    target, drafter, prompts = _setup("qwen3", num_drafter_layers=2)
    selector_drafter = _selector_drafter(drafter)
    for model in (drafter, selector_drafter):
        _overfit(target, model, prompts, steps=120)
        reports = {harness: evaluate_prompts(target=target, drafter=model, prompts=prompts, modes=("block",),
                                             max_new_tokens=_NEW, warmup=False, harness=harness)
                   for harness in ("eager", "graphs")}
        eager, graphed = (reports[h]["summaries"][0] for h in ("eager", "graphs"))
        assert graphed["harness"] == "graphs" and eager["harness"] == "eager"
        assert graphed["tau"] == eager["tau"] > 3.0 and graphed["all_match_target"]
        assert [r["accepted_per_round"] for r in graphed["responses"]] == \
            [r["accepted_per_round"] for r in eager["responses"]]
        assert "| block | graphs |" in reports["graphs"]["table"]


def test_the_harness_is_picked_by_device_and_mode_and_refusals_say_why():
    target, drafter, prompts = _setup("llama")
    assert pick_harness("auto", target=target, modes=("block",)) == "eager"  # CPU: nothing to remove
    assert pick_harness("graphs", target=target, modes=("block",)) == "graphs"
    with pytest.raises(ValueError, match="mode 'block' only"):
        pick_harness("graphs", target=target, modes=("block", "tree"))
    with pytest.raises(ValueError, match="harness must be one of"):
        pick_harness("fast", target=target, modes=("block",))
    hybrid, hybrid_drafter, _ = _setup("qwen3_5")
    assert pick_harness("auto", target=hybrid, modes=("block",)) == "eager"
    with pytest.raises(ValueError, match="recurrent"):
        GraphedDecoder(target=hybrid, drafter=hybrid_drafter, capacity=64)
    decoder = GraphedDecoder(target=target, drafter=drafter, capacity=40)
    with pytest.raises(ValueError, match="needs 41 cache positions; this decoder holds 40"):
        decoder.generate([1] * 9, max_new_tokens=24)
    with pytest.raises(ValueError, match="without a drafter"):
        GraphedDecoder(target=target, drafter=None, capacity=40).generate(prompts[0], max_new_tokens=2)
