"""The paper authors' own package serves our native export as we trained it.

z-lab's `dflash` 0.1.0 (PyPI, installed with --no-deps) is the reference DFlash runtime. For each
target family it must load our native export with no missing or unexpected weights, give the same
draft logits as our drafter for the same context and block, and, through its own `dflash_generate`
(greedy), give the same output tokens and the same per-round acceptance lengths as our evaluator.
A drafter trained for a few seconds to overfit the target's greedy continuations is used, so
acceptances are long and varied; a random drafter would make the comparison trivial.

Run: .venv/bin/python -m pytest tests/integration/test_zlab_parity.py -q
"""

import dataclasses
import time
import warnings

import pytest
import torch

zlab = pytest.importorskip("dflash.model", reason="dflash==0.1.0 (z-lab's reference) is not installed")

from dflash_core.evaluate import SpeculativeDecoder, greedy_decode  # noqa: E402
from dflash_core.export import export_drafter  # noqa: E402
from dflash_core.model import DFlashConfig, plan_blocks  # noqa: E402
from dflash_core.model.build import build_drafter  # noqa: E402
from dflash_core.model.loss_spec import LossSpec
from dflash_core.target import HiddenStateCapture, build_target, target_heads, tiny_target_config  # noqa: E402

_BLOCK, _NEW = 4, 24


def _trained_drafter(family, *, layer_types=None, sliding_window=None, intermediate_size=None, taps=2, steps=100):
    """A tiny target and a drafter overfit to its greedy continuations of two random prompts (`intermediate_size`:
    an MLP narrower than the target's, drafter.intermediate_size; `taps`: more tapped layers than drafter layers,
    as the default reads since it taps at least 5)."""
    torch.manual_seed(0)
    target_config = tiny_target_config(family, num_layers=8 if family == "qwen3_5" else 6)
    target = build_target(target_config).eval()
    config = DFlashConfig.from_target(target_config, num_layers=2, block_size=_BLOCK, num_tapped_layers=taps,
                                      layer_types=layer_types, sliding_window=sliding_window)
    if intermediate_size is not None:
        config = dataclasses.replace(config, intermediate_size=intermediate_size)
    drafter = build_drafter(config, loss=LossSpec(loss_gamma=2.0))
    drafter.attach_target(target_heads(target))
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, target_config.vocab_size, (n,), generator=generator).tolist() for n in (7, 11)]
    sequences = [p + greedy_decode(target, p, max_new_tokens=_NEW).tokens for p in prompts]
    length = max(len(s) for s in sequences)
    input_ids = torch.tensor([s + [0] * (length - len(s)) for s in sequences])
    loss_mask = torch.tensor([[0 < i < len(s) for i in range(length)] for s in sequences])
    captured = HiddenStateCapture(target, layer_ids=config.target_layer_ids, capture_final=True)(input_ids)
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=1e-2)
    for step in range(steps):
        plan = plan_blocks(loss_mask_BT=loss_mask, num_anchors=24, block_size=_BLOCK,
                           generator=torch.Generator().manual_seed(step))
        _, loss, _ = drafter(input_ids=input_ids, target_hidden=captured.tapped_hidden, plan=plan,
                             teacher_hidden=captured.final_hidden, attention_backend="sdpa")
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return target, target_config, drafter.eval(), prompts


def _load_with_zlab(path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, info = zlab.DFlashDraftModel.from_pretrained(path, output_loading_info=True, dtype=torch.float32)
    return model.eval(), info


def _zlab_generate(model, target, prompt, monkeypatch):
    # return_stats=True times rounds with torch.cuda.synchronize; on a CPU build time them plainly.
    monkeypatch.setattr(zlab, "_cuda_time", time.perf_counter)
    out = zlab.dflash_generate(model, target, torch.tensor([prompt]), max_new_tokens=_NEW, stop_token_ids=None,
                               temperature=0.0, return_stats=True)
    return out.output_ids[0, len(prompt):].tolist(), out.acceptance_lengths


CASES = [
    ("llama", None, None, None, 2),
    ("qwen3", None, None, None, 2),
    ("qwen3", ["sliding_attention", "full_attention"], 8, None, 2),
    ("qwen3_5", None, None, None, 2),
    ("qwen3", None, None, 48, 2),
    ("qwen3", None, None, None, 3),
]
IDS = ["llama", "qwen3", "qwen3-sliding-window", "qwen3_5-hybrid", "qwen3-narrow-mlp", "qwen3-three-taps"]


@pytest.fixture(scope="module", params=CASES, ids=IDS)
def exported(request, tmp_path_factory):
    family, layer_types, window, mlp, taps = request.param
    target, target_config, drafter, prompts = _trained_drafter(family, layer_types=layer_types,
                                                               sliding_window=window, intermediate_size=mlp, taps=taps)
    out = tmp_path_factory.mktemp(f"zlab-{family}")
    path = export_drafter(drafter, target_config=target_config, out_dir=out, formats=("native",))["native"]
    return target, drafter, prompts, path


def test_zlab_loads_every_weight_and_reads_our_conventions(exported):
    _, drafter, _, path = exported
    theirs, info = _load_with_zlab(path)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    ours = drafter.config
    assert theirs.target_layer_ids == ours.target_layer_ids
    assert theirs.mask_token_id == ours.mask_token_id and theirs.block_size == ours.block_size
    for index, (layer, layer_type) in enumerate(zip(theirs.layers, ours.layer_types)):
        attention = layer.self_attn
        # Our blocks are non-causal on every layer type; the reference makes sliding layers causal
        # unless the config says otherwise.
        assert attention.is_causal is False, index
        assert attention.sliding_window == (ours.sliding_window if layer_type == "sliding_attention" else None)
    state = theirs.state_dict()
    for name, tensor in drafter.state_dict().items():
        assert torch.equal(state[name], tensor), name


def test_zlab_drafts_the_same_logits(exported):
    target, drafter, prompts, path = exported
    theirs, _ = _load_with_zlab(path)
    prompt = prompts[1]
    capture = HiddenStateCapture(target, layer_ids=drafter.config.target_layer_ids, capture_final=False)
    with torch.no_grad():
        context = capture(torch.tensor([prompt])).tapped_hidden  # [1, n, L*H]
        anchor = int(target(torch.tensor([prompt])).logits[0, -1].argmax())
        n = len(prompt)
        cache = drafter.new_cache()
        drafter.extend_context(cache, target_hidden=context, position_ids=torch.arange(n)[None])
        ours = drafter.draft_block(cache, last_token_ids=torch.tensor([anchor]), position_ids=torch.tensor([n]))
        block = torch.full((1, _BLOCK), drafter.config.mask_token_id)
        block[0, 0] = anchor
        hidden = theirs(target_hidden=context, noise_embedding=target.get_input_embeddings()(block),
                        position_ids=torch.arange(n + _BLOCK)[None])
        reference = theirs.compute_logits(hidden[:, 1:], target.lm_head)
    torch.testing.assert_close(reference, ours, atol=1e-4, rtol=1e-4)


def test_zlab_generate_matches_our_evaluator_round_for_round(exported, monkeypatch):
    target, drafter, prompts, path = exported
    theirs, _ = _load_with_zlab(path)
    decoder = SpeculativeDecoder(target=target, drafter=drafter, mode="block")
    rounds = 0
    for prompt in prompts:
        ours = decoder.generate(prompt, max_new_tokens=_NEW)
        tokens, acceptance_lengths = _zlab_generate(theirs, target, prompt, monkeypatch)
        assert tokens == ours.tokens == greedy_decode(target, prompt, max_new_tokens=_NEW).tokens
        # Per round: accepted drafts + 1. z-lab shortens the last block to the tokens still wanted
        # (the first new token comes from the prefill), so its last round counts only what was kept.
        expected = [a + 1 for a in ours.accepted]
        assert acceptance_lengths[:-1] == expected[:-1]
        assert acceptance_lengths[-1] == min(expected[-1], _NEW - 1 - sum(acceptance_lengths[:-1]))
        rounds += len(expected)
    assert rounds < 2 * _NEW / 2, "the overfit drafter should be accepted often"
