"""Speculative decoding rounds on tiny targets: the output is the target's greedy decoding token for
token, in block and DDTree mode, whatever the drafter proposes; tau tracks what the drafter knows.

Three drafters are used, and each shows something different:
  - a random-init DFlash drafter: almost every draft is rejected (tau ~1), which exercises the
    reject/crop path;
  - an "oracle" test double that proposes the target's true continuation with planted mistakes
    (the true token ranked second): exercises every acceptance length and the cache crops,
    and shows that a tree recovers what a block loses. It is not a DFlash model;
  - a real DFlash drafter trained for a few seconds to overfit the target's greedy outputs on the
    very prompts it is evaluated on: tau near the block size. This shows the evaluator measures
    what the drafter learned, not that a drafter generalizes.

Run: .venv/bin/python -m pytest tests/unit/test_evaluate_speculative.py -q
"""

import warnings

import pytest
import torch

from dflash_core.evaluate import SpeculativeDecoder, evaluate_prompts, greedy_decode
from dflash_core.model import DFlashConfig, plan_blocks
from dflash_core.model.build import build_drafter
from dflash_core.model.loss_spec import LossSpec
from dflash_core.target import HiddenStateCapture, build_target, target_heads, tiny_target_config

_BLOCK, _NEW = 4, 24


pytestmark = pytest.mark.usefixtures("one_thread")


def _setup(family, *, num_drafter_layers=1, seed=0):
    torch.manual_seed(seed)
    target_config = tiny_target_config(family, num_layers=8 if family == "qwen3_5" else 6)
    target = build_target(target_config)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = DFlashConfig.from_target(target_config, num_layers=num_drafter_layers, block_size=_BLOCK,
                                          num_tapped_layers=2)
    drafter = build_drafter(config, loss=LossSpec(loss_gamma=2.0))
    drafter.attach_target(target_heads(target))
    generator = torch.Generator().manual_seed(seed + 1)
    prompts = [torch.randint(1, target_config.vocab_size, (n,), generator=generator).tolist() for n in (7, 11)]
    return target, drafter, prompts


class _OracleDrafter:
    """Test double: the real drafter's context cache, but drafts read off the target's known greedy
    sequence; at every position divisible by `wrong_every` the top token is wrong and the true one
    is second. It also checks the evaluator's bookkeeping: the context holds exactly the tokens
    before the last accepted one, and that token is the true one."""

    def __init__(self, drafter, sequence, *, wrong_every):
        self.inner, self.config, self.fc = drafter, drafter.config, drafter.fc
        self.sequence, self.wrong_every = sequence, wrong_every

    def eval(self):
        return self

    def new_cache(self):
        return self.inner.new_cache()

    def new_static_cache(self, **kwargs):
        return self.inner.new_static_cache(**kwargs)

    def extend_context(self, cache, **kwargs):
        self.inner.extend_context(cache, **kwargs)

    def draft_block(self, cache, *, last_token_ids, position_ids):
        position = int(position_ids[0])
        assert cache.length == position and int(last_token_ids[0]) == self.sequence[position]
        logits = torch.zeros(1, self.config.block_size - 1, self.config.vocab_size)
        for k in range(1, self.config.block_size):
            index = position + k
            true = self.sequence[index] if index < len(self.sequence) else 0
            if index % self.wrong_every == 0:
                logits[0, k - 1, (true + 1) % self.config.vocab_size] = 5.0
                logits[0, k - 1, true] = 4.0
            else:
                logits[0, k - 1, true] = 5.0
        return logits


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("mode", ["block", "tree"])
def test_random_drafter_output_equals_greedy_decoding(family, mode):
    target, drafter, prompts = _setup(family)
    decoder = SpeculativeDecoder(target=target, drafter=drafter, mode=mode, tree_budget=8)
    for prompt in prompts:
        reference = greedy_decode(target, prompt, max_new_tokens=_NEW)
        decoded = decoder.generate(prompt, max_new_tokens=_NEW)
        assert decoded.tokens == reference.tokens
        if mode == "block":  # random drafts are (almost) never accepted; a tree of 8 may hit a looping token
            assert decoded.tau < 1.5
        assert len(decoded.accepted) >= _NEW // _BLOCK


def test_our_greedy_baseline_is_transformers_generate():
    target, _, prompts = _setup("llama")
    expected = target.generate(torch.tensor([prompts[0]]), max_new_tokens=_NEW, min_new_tokens=_NEW, do_sample=False)
    assert greedy_decode(target, prompts[0], max_new_tokens=_NEW).tokens == expected[0, len(prompts[0]):].tolist()


@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen3_5"])
def test_partial_acceptances_keep_the_output_exact_and_trees_recover_mistakes(family):
    target, drafter, prompts = _setup(family)
    taus = {}
    modes = ["block"] if family == "qwen3_5" else ["block", "tree"]
    for prompt in prompts:
        reference = greedy_decode(target, prompt, max_new_tokens=_NEW)
        oracle = _OracleDrafter(drafter, prompt + reference.tokens, wrong_every=5)
        for mode in modes:
            decoded = SpeculativeDecoder(target=target, drafter=oracle, mode=mode, tree_budget=8).generate(
                prompt, max_new_tokens=_NEW)
            assert decoded.tokens == reference.tokens, mode
            taus.setdefault(mode, []).append(decoded.tau)
            if mode == "block":
                assert set(decoded.accepted[:-1]) > {0, _BLOCK - 1} or len(set(decoded.accepted)) >= 2
    assert 1.5 < min(taus["block"]) and max(taus["block"]) < _BLOCK
    if "tree" in taus:  # the planted mistake is the second-ranked token: the tree keeps it
        assert min(taus["tree"]) > max(taus["block"])


def test_hybrid_target_refuses_tree_mode():
    target, drafter, _ = _setup("qwen3_5")
    with pytest.raises(ValueError, match="hybrid"):
        SpeculativeDecoder(target=target, drafter=drafter, mode="tree")


def test_eos_and_max_new_tokens_stop_decoding():
    target, drafter, prompts = _setup("qwen3")
    reference = greedy_decode(target, prompts[0], max_new_tokens=_NEW)
    eos = reference.tokens[5]
    oracle = _OracleDrafter(drafter, prompts[0] + reference.tokens, wrong_every=1000)
    decoded = SpeculativeDecoder(target=target, drafter=oracle).generate(prompts[0], max_new_tokens=_NEW,
                                                                         eos_token_id=eos)
    assert decoded.tokens == reference.tokens[: reference.tokens.index(eos) + 1]
    assert len(SpeculativeDecoder(target=target, drafter=oracle).generate(prompts[0], max_new_tokens=3).tokens) == 3
    with pytest.raises(ValueError, match="max_new_tokens"):
        SpeculativeDecoder(target=target, drafter=drafter).generate(prompts[0], max_new_tokens=0)
    with pytest.raises(ValueError, match="mode"):
        SpeculativeDecoder(target=target, drafter=drafter, mode="beam")


def _overfit(target, drafter, prompts, *, steps):
    """Train the drafter on the target's own greedy continuations of `prompts` (teacher labels)."""
    sequences = [p + greedy_decode(target, p, max_new_tokens=_NEW).tokens for p in prompts]
    length = max(len(s) for s in sequences)
    input_ids = torch.tensor([s + [0] * (length - len(s)) for s in sequences])
    loss_mask = torch.tensor([[i < len(s) for i in range(length)] for s in sequences])
    captured = HiddenStateCapture(target, layer_ids=drafter.config.target_layer_ids, capture_final=True)(input_ids)
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=1e-2)
    for step in range(steps):
        plan = plan_blocks(loss_mask_BT=loss_mask, num_anchors=24,
                           block_size=_BLOCK, generator=torch.Generator().manual_seed(step))
        _, loss, _ = drafter(input_ids=input_ids, target_hidden=captured.tapped_hidden, plan=plan,
                             teacher_hidden=captured.final_hidden)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def test_a_drafter_that_learned_the_target_reaches_high_tau_and_a_random_one_does_not():
    target, drafter, prompts = _setup("qwen3", num_drafter_layers=2)
    before = evaluate_prompts(target=target, drafter=drafter, prompts=prompts, modes=("block", "tree"),
                              max_new_tokens=_NEW, tree_budget=8, warmup=False)
    _overfit(target, drafter, prompts, steps=120)
    after = evaluate_prompts(target=target, drafter=drafter, prompts=prompts, modes=("block", "tree"),
                             max_new_tokens=_NEW, tree_budget=8, warmup=False)
    for summary in before["summaries"]:
        assert summary["tau"] < (1.3 if summary["mode"] == "block" else 2.0) and summary["all_match_target"]
    for summary in after["summaries"]:
        assert summary["tau"] > 3.0 and summary["all_match_target"]  # of at most 4 (= block size)
        assert summary["acceptance_per_position"][0] > 0.9
        assert summary["target_forwards"] < summary["new_tokens"] / 2  # far fewer target passes than tokens
    assert "| block |" in after["table"] and "| tree |" in after["table"]


def _selector_drafter(base):
    """A DFlash 2 drafter (candidate selector) of `base`'s shape, attached to the same target."""
    from dflash_core.model.dflash2 import DFlash2Config

    torch.manual_seed(0)
    config = DFlash2Config.from_dflash(base.config, conv_group_size=16, selector_rank=8, selector_top_k=4)
    drafter = build_drafter(config, loss=base.loss)
    drafter.attach_target(base.target_heads)
    return drafter


def test_a_dflash2_drafter_decodes_on_its_selector_path_in_block_mode_only():
    target, base, prompts = _setup("qwen3", num_drafter_layers=2)
    drafter = _selector_drafter(base)
    _overfit(target, drafter, prompts, steps=120)
    proposals = []
    select = drafter.draft_tokens
    drafter.draft_tokens = lambda cache, **kwargs: proposals.append(select(cache, **kwargs)) or proposals[-1]
    report = evaluate_prompts(target=target, drafter=drafter, prompts=prompts, modes=("block",),
                              max_new_tokens=_NEW, warmup=False)
    summary = report["summaries"][0]
    assert summary["all_match_target"] and summary["tau"] > 3.0  # of at most 4 (= block size)
    assert len(proposals) == summary["num_rounds"]  # every round drafted through the selector
    with pytest.raises(ValueError, match="DFlash-only"):
        SpeculativeDecoder(target=target, drafter=drafter, mode="tree")


@pytest.mark.parametrize("mode", ["block", "tree"])
def test_the_last_round_counts_only_the_tokens_that_fit(mode):
    """An oracle accepts every draft: each round adds B tokens (B-1 drafts + bonus) after the prefill's
    one. With room for fewer, the last round counts exactly what fits, never the whole verified block."""
    from dflash_core.evaluate import summarize
    from dflash_core.evaluate.report import ResponseResult

    target, drafter, prompts = _setup("qwen3")
    reference = greedy_decode(target, prompts[0], max_new_tokens=_NEW)
    oracle = _OracleDrafter(drafter, prompts[0] + reference.tokens, wrong_every=1000)
    decoder = SpeculativeDecoder(target=target, drafter=oracle, mode=mode, tree_budget=8)
    full = _BLOCK - 1
    for max_new, expected in [(1 + _BLOCK, [full]), (2 + _BLOCK, [full, 0]), (3 + _BLOCK, [full, 1]),
                              (1 + 2 * _BLOCK - 1, [full, full - 1]), (1 + 2 * _BLOCK, [full, full])]:
        decoded = decoder.generate(prompts[0], max_new_tokens=max_new)
        assert decoded.tokens == reference.tokens[:max_new]
        assert decoded.accepted == expected, max_new
        assert sum(a + 1 for a in decoded.accepted) == len(decoded.tokens) - 1
    decoded = decoder.generate(prompts[0], max_new_tokens=3 + _BLOCK)  # rounds of 4 then 2 tokens
    assert decoded.tau == pytest.approx((_BLOCK + 2) / 2)
    summary = summarize([ResponseResult(prompt_index=0, prompt_tokens=len(prompts[0]), decoded=decoded,
                                        baseline_wall_s=1.0, matches_target=True)], block_size=_BLOCK, mode=mode)
    assert summary["acceptance_per_position"] == [1.0, 0.5, 0.5]


def test_an_eos_accepted_mid_block_ends_the_count_there():
    """An EOS the target accepts among the drafts ends the response: the tokens verified after it in
    the same round are neither emitted nor counted."""
    target, drafter, prompts = _setup("qwen3")
    reference = greedy_decode(target, prompts[0], max_new_tokens=_NEW).tokens
    oracle = _OracleDrafter(drafter, prompts[0] + reference, wrong_every=1000)
    decoder = SpeculativeDecoder(target=target, drafter=oracle)
    # Token j is emitted by round (j - 1) // B + 1 at slot (j - 1) % B; take first occurrences that are
    # not a round's last token, so the round verified tokens after the EOS.
    cases = [j for j in range(1, _NEW - _BLOCK) if reference[j] not in reference[:j] and (j - 1) % _BLOCK < _BLOCK - 1]
    assert len(cases) >= 2
    for j in cases[:4]:
        decoded = decoder.generate(prompts[0], max_new_tokens=_NEW, eos_token_id=reference[j])
        assert decoded.tokens == reference[: j + 1]
        assert decoded.accepted == [_BLOCK - 1] * ((j - 1) // _BLOCK) + [(j - 1) % _BLOCK], j


@pytest.mark.parametrize("mode", ["block", "tree"])
def test_a_round_time_is_split_into_draft_verify_and_the_rest(mode):
    target, drafter, prompts = _setup("llama")
    out = evaluate_prompts(target=target, drafter=drafter, prompts=prompts, modes=(mode,), max_new_tokens=_NEW)
    summary = out["summaries"][0]
    split = summary["round_ms"]
    assert split["draft"] > 0 and split["verify"] > 0 and split["other"] >= 0 and split["target_step"] > 0
    wall_ms = 1000 * sum(r["wall_s"] for r in summary["responses"])
    # the phases never add up to more than the responses' wall time, which also holds the prefill
    assert (split["draft"] + split["verify"]) * summary["num_rounds"] <= wall_ms
    assert "draft / verify / other" in out["table"]
