"""A real consumer loads our DFlash 2 export: z-lab's own `DFlash2DraftModel` (PyPI `dflash` 0.1.0)
must load it with no missing or unexpected keys and compute the same drafter states and the same
selector proposals; its `dflash_generate` must give the same tokens and acceptance lengths as our
speculative decoder drafting through the selector path.

`dflash` is installed with --no-deps (infra/setup.sh); the module skips cleanly when it is absent.

Run: .venv/bin/python -m pytest tests/integration/test_zlab_dflash2_parity.py -q
"""

import dataclasses
import time
import warnings

import pytest
import torch

zlab = pytest.importorskip("dflash.model", reason="z-lab's dflash==0.1.0 is not installed")

from dflash_core.evaluate.speculative import SpeculativeDecoder, greedy_decode  # noqa: E402
from dflash_core.model import plan_blocks  # noqa: E402
from dflash_core.model.build import build_drafter  # noqa: E402
from dflash_core.model.loss_spec import LossSpec
from dflash_core.model.anchors import BlockPlan  # noqa: E402
from dflash_core.model.dflash2 import DFlash2Config  # noqa: E402
from dflash_core.export import export_drafter  # noqa: E402
from dflash_core.target import (  # noqa: E402
    HiddenStateCapture,
    build_target,
    target_heads,
    tiny_target_config,
)

_BLOCK, _SEQ = 4, 40
_TRANSFORMS = [(1.0, None), (0.8, 4.0)]  # (output_multiplier, final_logit_softcapping)


def _pair(tmp_path, *, output_multiplier, softcap, prompt=None):
    """Our drafter and z-lab's model loaded from its export. Every parameter is moved off its init;
    with a prompt the drafter then learns the target's greedy continuation of it, so decoding
    accepts drafts."""
    torch.manual_seed(0)
    target_config = tiny_target_config("qwen3")
    target = build_target(target_config).eval()
    config = DFlash2Config.from_target(
        target_config,
        num_layers=2,
        block_size=_BLOCK,
        num_tapped_layers=2,
        conv_kernel_size=2,
        conv_group_size=16,
        selector_rank=8,
        selector_top_k=6,
        output_multiplier=output_multiplier,
        final_logit_softcapping=softcap,
    )
    drafter = build_drafter(config, loss=LossSpec(loss_gamma=2.0))
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, parameter in drafter.named_parameters():
            # Large selector tables so the transition term really moves proposals off the argmax.
            scale = 1.0 if name.startswith("candidate_selector") else 0.1
            parameter.add_(scale * torch.randn(parameter.shape, generator=generator))
    drafter.attach_target(target_heads(target))
    if prompt is not None:
        _learn_continuation(drafter, target, prompt)
    path = export_drafter(drafter, target_config=target_config, out_dir=tmp_path, formats=("native",))["native"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reference, info = zlab.DFlash2DraftModel.from_pretrained(path, output_loading_info=True)
    return target, drafter, reference.eval(), info


def _learn_continuation(drafter, target, prompt, *, min_steps=100, max_steps=600):
    continuation = greedy_decode(target, prompt, max_new_tokens=40).tokens
    input_ids = torch.tensor([prompt + continuation])
    captured = HiddenStateCapture(target, layer_ids=drafter.config.target_layer_ids, capture_final=True)(
        input_ids
    )
    loss_mask = torch.zeros_like(input_ids, dtype=torch.bool)
    loss_mask[:, len(prompt) - 1 :] = True
    plan = plan_blocks(loss_mask_BT=loss_mask, num_anchors=input_ids.shape[1], block_size=_BLOCK)
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=1e-2)
    # Until the selector accepts > 2.5 tokens a block: how many steps that takes depends on the CPU's
    # float kernels (150 were enough on one machine, not on another).
    for step in range(1, max_steps + 1):
        _, loss, metrics = drafter(
            input_ids=input_ids,
            target_hidden=captured.tapped_hidden,
            plan=plan,
            teacher_hidden=captured.final_hidden,
        )
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step >= min_steps and metrics["selector_acceptance_length"] > 2.5:
            break
    assert metrics["selector_acceptance_length"] > 2.5, metrics


@pytest.fixture(scope="module", params=_TRANSFORMS, ids=["plain", "multiplier+softcap"])
def pair(request, tmp_path_factory):
    """Built once per transform: the tests that take it only read the pair."""
    multiplier, softcap = request.param
    return _pair(tmp_path_factory.mktemp("zlab-dflash2"), output_multiplier=multiplier, softcap=softcap)


def test_zlab_loads_every_weight_and_config_field(pair):
    _, drafter, reference, info = pair
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    ours = drafter.state_dict()
    theirs = reference.state_dict()
    for name, tensor in ours.items():  # the codebooks are nn.Embedding weights on their side
        other = theirs[name] if name in theirs else theirs[f"{name}.weight"]
        assert torch.equal(tensor, other), name
    cfg = drafter.config
    assert reference.block_size == cfg.block_size and reference.mask_token_id == cfg.mask_token_id
    assert reference.target_layer_ids == cfg.target_layer_ids
    assert reference.candidate_selector.top_k == cfg.selector_top_k


def _reference_block(reference, target, tapped, *, anchor_token, context_len):
    """z-lab's drafting call: context features, the raw block embedding, positions [0, T + B)."""
    block_ids = torch.full((1, _BLOCK), reference.mask_token_id)
    block_ids[0, 0] = anchor_token
    with torch.no_grad():
        hidden = reference(
            target_hidden=tapped[:, :context_len],
            noise_embedding=target.get_input_embeddings()(block_ids),
            position_ids=torch.arange(context_len + _BLOCK)[None],
            use_cache=False,
        )[:, 1:]
        path, _, _ = reference.propose(hidden, block_ids[:, 0], target.lm_head, 0.0)
    return hidden, path


def test_same_states_and_same_selector_proposals(pair):
    target, drafter, reference, _ = pair
    input_ids = torch.randint(1, 256, (1, _SEQ))
    tapped = HiddenStateCapture(target, layer_ids=drafter.config.target_layer_ids, capture_final=False)(
        input_ids
    ).tapped_hidden
    differs_from_argmax = False
    for context_len in (1, 7, 19, 33):
        cache = drafter.new_cache()
        drafter.extend_context(
            cache, target_hidden=tapped[:, :context_len], position_ids=torch.arange(context_len)[None]
        )
        kwargs = dict(last_token_ids=input_ids[:, context_len], position_ids=torch.tensor([context_len]))
        hidden = drafter.draft_hidden(cache, **kwargs)
        ours = drafter.draft_tokens(cache, **kwargs)
        ref_hidden, ref_path = _reference_block(
            reference, target, tapped, anchor_token=input_ids[0, context_len], context_len=context_len
        )
        torch.testing.assert_close(hidden, ref_hidden, atol=1e-5, rtol=1e-4)
        with torch.no_grad():
            torch.testing.assert_close(
                drafter.draft_block(cache, **kwargs),
                reference.compute_logits(ref_hidden, target.lm_head),
                atol=1e-5,
                rtol=1e-4,
            )
        assert torch.equal(ours, ref_path), context_len
        differs_from_argmax |= bool((ours != drafter.draft_block(cache, **kwargs).argmax(-1)).any())
    assert differs_from_argmax  # the selector is exercised, not just the unary argmax


def test_training_blocks_equal_zlab_drafting(pair):
    """Many blocks back to back in one training sequence, each equal to z-lab's drafting of it alone."""
    target, drafter, reference, _ = pair
    input_ids = torch.randint(1, 256, (1, _SEQ))
    tapped = HiddenStateCapture(target, layer_ids=drafter.config.target_layer_ids, capture_final=False)(
        input_ids
    ).tapped_hidden
    anchors = [3, 7, 11, 26]
    plan = BlockPlan.at_anchors(anchors, seq_len=_SEQ, block_size=_BLOCK)
    with torch.no_grad():
        out, _, _ = drafter(input_ids=input_ids, target_hidden=tapped, plan=plan)
    for slot, anchor in enumerate(anchors):
        ref_hidden, _ = _reference_block(
            reference, target, tapped, anchor_token=input_ids[0, anchor], context_len=anchor
        )
        torch.testing.assert_close(out.hidden_BAKH[:, slot], ref_hidden, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize(("multiplier", "softcap"), _TRANSFORMS, ids=["plain", "multiplier+softcap"])
def test_dflash_generate_gives_our_tokens_and_acceptance_lengths(tmp_path, monkeypatch, multiplier, softcap):
    torch.manual_seed(5)
    prompt = torch.randint(1, 256, (1, 12))
    target, drafter, reference, _ = _pair(
        tmp_path, output_multiplier=multiplier, softcap=softcap, prompt=prompt[0].tolist()
    )
    monkeypatch.setattr(zlab, "_cuda_time", time.perf_counter)  # its timers synchronize CUDA
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = zlab.dflash_generate(
            reference, target, prompt, max_new_tokens=30, stop_token_ids=None, return_stats=True
        )
    ours = SpeculativeDecoder(target=target, drafter=drafter).generate(prompt[0].tolist(), max_new_tokens=30)
    assert result.output_ids[0, prompt.shape[1] :].tolist() == ours.tokens
    assert result.acceptance_lengths == [accepted + 1 for accepted in ours.accepted]
    assert sum(ours.accepted) >= len(ours.tokens) // 2  # drafts are accepted: the selector path is served


def test_speculators_dflash2_loads_our_weights_and_scores_the_same(tmp_path):
    """speculators 0.9's experimental DFlash2 (the vLLM-side format): same states, unary logits and
    selector scores for the same blocks. Its contract has no logit multiplier or softcap."""
    speculators = pytest.importorskip(
        "speculators.models.dflash2", reason="speculators==0.9.0 is not installed"
    )
    target, drafter, _, _ = _pair(tmp_path, output_multiplier=1.0, softcap=None)
    verifier_dir = tmp_path / "verifier"
    target.save_pretrained(verifier_dir)
    export_dir = export_drafter(drafter, target_config=target.config, out_dir=tmp_path,
                                verifier_name_or_path=str(verifier_dir), formats=("speculators",))["speculators"]
    config = speculators.DFlash2SpeculatorConfig.from_pretrained(export_dir)
    config.transformer_layer_config._attn_implementation = "sdpa"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = speculators.DFlash2DraftModel.from_pretrained(export_dir, config=config).eval()
    assert theirs.target_layer_ids == [k + 1 for k in drafter.config.target_layer_ids]
    assert torch.equal(
        theirs.candidate_selector.predecessor_codebook, drafter.candidate_selector.predecessor_codebook
    )

    anchors, seq = [3, 9, 15], 24
    input_ids = torch.randint(1, 256, (1, seq))
    captured = HiddenStateCapture(target, layer_ids=drafter.config.target_layer_ids, capture_final=True)(
        input_ids
    )
    loss_mask = torch.zeros(1, seq, dtype=torch.long)
    loss_mask[0, anchors] = 1  # exactly as many valid positions as anchors: no random choice
    with torch.no_grad():
        states = target(input_ids, output_hidden_states=True).hidden_states
        aux = torch.cat([states[k] for k in theirs.target_layer_ids], dim=-1)  # its ids index hidden_states
        hidden, logits, _, _, block_index = theirs._backbone_forward(
            aux,
            input_ids,
            loss_mask,
            captured.final_hidden,
            torch.zeros(1, seq, dtype=torch.long),
            max_anchors=len(anchors),
        )
        plan = BlockPlan.at_anchors(anchors, seq_len=seq, block_size=_BLOCK)
        ours, _, _ = drafter(
            input_ids=input_ids, target_hidden=captured.tapped_hidden, plan=plan, attention_backend="sdpa"
        )
        drafted = hidden.view(3, _BLOCK, -1)[:, 1:]
        torch.testing.assert_close(drafted, ours.hidden_BAKH[0], atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(
            logits.view(3, _BLOCK, -1)[:, 1:], drafter.unary_logits(ours.hidden_BAKH[0]), atol=1e-5, rtol=1e-4
        )
        predecessors = theirs._predecessor_ids(input_ids, block_index).reshape(1, -1)
        candidates = logits.topk(drafter.config.selector_top_k, dim=-1).indices
        their_scores = theirs.candidate_selector.score_candidates(logits, hidden, predecessors, candidates)
        selector = drafter.candidate_selector
        our_scores = logits.gather(-1, candidates) + selector.transition_scores(
            selector.context(hidden, predecessors), candidates
        )
    torch.testing.assert_close(their_scores, our_scores)
    softcapped = build_drafter(dataclasses.replace(drafter.config, final_logit_softcapping=4.0))
    softcapped.load_state_dict(drafter.state_dict())
    with pytest.raises(ValueError, match="softcapping"):
        export_drafter(softcapped, target_config=target.config, out_dir=tmp_path / "refused",
                       verifier_name_or_path=str(verifier_dir), formats=("speculators",))
    assert not (tmp_path / "refused").exists()
