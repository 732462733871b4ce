"""DFlash 2's selector codebooks from the target embedding (`selector_codebook_init: embedding`): the
codes are the embedding's top principal components at the random init's scale, the trainer's assembly
applies them (and only when asked), and a training step from them has a finite gradient.

Run: .venv/bin/python -m pytest -q tests/unit/test_levers_selector_init.py
"""

import pytest
import torch

from dflash_core.model.dflash2 import CandidateSelector
from dflash_core.model.init_from_target import embedding_principal_codes, init_selector_codebooks
from dflash_core.model import plan_blocks
from dflash_core.target import HiddenStateCapture, build_target, tiny_target_config
from dflash_core.train.assemble import _build_drafter
from dflash_core.train.config import DrafterSettings, TrainConfig
from dflash_core.train.devices import TrainDevices
from dflash_core.train.drafter_setup import drafter_config_for

_VOCAB, _WIDTH, _RANK, _STD = 300, 24, 6, 0.02


def _embedding(seed: int = 0) -> torch.Tensor:
    """A low-rank-plus-noise embedding with an offset, so its top directions are distinct and the mean matters."""
    generator = torch.Generator().manual_seed(seed)
    scales = torch.tensor([8.0, 6.0, 5.0, 4.0, 3.0, 2.5, 2.0, 1.5])
    basis = torch.linalg.qr(torch.randn(_WIDTH, _WIDTH, generator=generator)).Q[:, :8]
    coefficients = torch.randn(_VOCAB, 8, generator=generator) * scales
    return coefficients @ basis.T + 0.05 * torch.randn(_VOCAB, _WIDTH, generator=generator) + 3.0


def _top_left_singular(embedding: torch.Tensor, rank: int) -> torch.Tensor:
    centered = embedding - embedding.mean(0)
    u, _, _ = torch.linalg.svd(centered, full_matrices=False)
    return u[:, :rank]


def test_codes_are_the_embeddings_top_principal_components():
    embedding = _embedding()
    codes = embedding_principal_codes(embedding, rank=_RANK, chunk_rows=64)  # uneven chunks
    centered = embedding - embedding.mean(0)
    u, s, vh = torch.linalg.svd(centered, full_matrices=False)
    # Column j is +-(the j-th left singular vector x its singular value), largest first.
    expected = u[:, :_RANK] * s[:_RANK]
    signs = torch.sign((codes * expected).sum(0))
    torch.testing.assert_close(codes * signs, expected, atol=1e-3, rtol=1e-3)


def test_init_spans_the_top_directions_at_the_random_inits_scale():
    embedding = _embedding()
    selector = CandidateSelector(vocab_size=_VOCAB, hidden_size=16, rank=_RANK, top_k=4)
    selector.reset_parameters(std=_STD)
    projection = selector.hidden_projection.weight.clone()
    init_selector_codebooks(selector, embedding, std=_STD)
    top = _top_left_singular(embedding, _RANK)
    for codebook in (selector.predecessor_codebook, selector.successor_codebook):
        inside = top @ (top.T @ codebook)
        torch.testing.assert_close(inside, codebook.detach(), atol=1e-5, rtol=1e-4)  # in the top-r span
        assert torch.linalg.matrix_rank(codebook.detach()) == _RANK  # and spans all of it
        assert codebook.std().item() == pytest.approx(_STD, rel=1e-3)
    assert torch.equal(selector.predecessor_codebook, selector.successor_codebook)
    assert torch.equal(selector.hidden_projection.weight, projection)  # only the codebooks change
    # A random init is nowhere near that span.
    random = CandidateSelector(vocab_size=_VOCAB, hidden_size=16, rank=_RANK, top_k=4)
    random.reset_parameters(std=_STD)
    off = random.predecessor_codebook.detach()
    assert (top @ (top.T @ off) - off).norm() > 0.9 * off.norm()


def test_a_rank_past_the_embeddings_width_keeps_the_random_columns():
    embedding = _embedding()[:, :4]
    selector = CandidateSelector(vocab_size=_VOCAB, hidden_size=16, rank=_RANK, top_k=4)
    selector.reset_parameters(std=_STD)
    before = selector.successor_codebook.detach().clone()
    init_selector_codebooks(selector, embedding, std=_STD)
    assert torch.equal(selector.successor_codebook[:, 4:], before[:, 4:])
    assert not torch.equal(selector.successor_codebook[:, :4], before[:, :4])
    with pytest.raises(ValueError, match="rows"):
        init_selector_codebooks(selector, embedding[:-1], std=_STD)


def test_the_trainer_applies_it_and_a_step_from_it_has_a_finite_gradient():
    with pytest.raises(ValueError, match="variant=dflash2"):
        DrafterSettings(variant="dflash", selector_codebook_init="embedding")
    drafter_settings = {"num_layers": 1, "block_size": 4, "loss_gamma": 2.0, "selector_rank": 8,
                        "selector_top_k": 4, "conv_group_size": 16, "mask_token_id": 5}
    cpu = torch.device("cpu")
    devices = TrainDevices(target=cpu, drafter=cpu)
    torch.manual_seed(0)
    target = build_target(tiny_target_config("qwen3"))
    built = {}
    for init in ("random", "embedding"):
        config = TrainConfig(target="tiny:qwen3", data=["x"],
                             drafter={**drafter_settings, "selector_codebook_init": init})
        drafter_config = drafter_config_for(config, target_config=target.config)
        built[init] = _build_drafter(drafter_config, target, config=config, devices=devices)
    embedding = target.get_input_embeddings().weight.detach()
    top = _top_left_singular(embedding.float(), 8)
    codebook = built["embedding"].candidate_selector.predecessor_codebook.detach()
    torch.testing.assert_close(top @ (top.T @ codebook), codebook, atol=1e-4, rtol=1e-3)
    random_codebook = built["random"].candidate_selector.predecessor_codebook.detach()
    assert codebook.std().item() == pytest.approx(random_codebook.std().item(), rel=0.05)
    # Everything but the codebooks is the seed's init either way.
    for (name, a), (_, b) in zip(built["random"].named_parameters(), built["embedding"].named_parameters()):
        assert torch.equal(a, b) == ("codebook" not in name), name

    drafter = built["embedding"]
    input_ids = torch.randint(6, 200, (1, 32))
    captured = HiddenStateCapture(target, layer_ids=drafter.config.target_layer_ids, capture_final=True)(input_ids)
    plan = plan_blocks(loss_mask_BT=torch.ones(1, 32, dtype=torch.bool), num_anchors=6, block_size=4,
                       generator=torch.Generator().manual_seed(0))
    _, loss, _ = drafter(input_ids=input_ids, target_hidden=captured.tapped_hidden, plan=plan,
                         teacher_hidden=captured.final_hidden)
    loss.backward()
    grad = drafter.candidate_selector.predecessor_codebook.grad
    assert torch.isfinite(loss) and grad is not None and torch.isfinite(grad).all() and grad.abs().sum() > 0
