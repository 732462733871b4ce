"""The drafter loss's LM-head GEMMs in FP8 (dflash_core.model.lm_head_fp8.Fp8LMHead, TrainConfig.lm_head_fp8): each GEMM is
the one of its quantized operands, the DFlash and DFlash 2 losses stay close to their bf16 selves with gradients
pointing the same way, everything else that reads the head keeps the exact weight, and the trainer trains with
it. CPU runs torch._scaled_mm (e4m3 and e5m2), so all of this runs here.

Run: .venv/bin/python -m pytest tests/unit/test_lm_head_fp8.py -q
"""

from __future__ import annotations

import pytest
import torch

from dflash_core.fp8 import target as fp8_module
from dflash_core.fp8.target import FP8, quantize_rows
from dflash_core.model.lm_head_fp8 import GRAD_FP8, Fp8LMHead
from dflash_core.model.dflash2 import CandidateSelector
from dflash_core.model.dflash2_loss import dflash2_objective
from dflash_core.model.loss import chunked_lm_head_loss
from dflash_core.train.assemble import build_trainer
from dflash_core.train.devices import TrainDevices
from dflash_core.train.entry import refuse_unsupported_fp8
from tests.unit.test_trainer import tiny_config

VOCAB, WIDTH, ROWS = 4096, 64, 320


def _relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual.double() - expected.double()).norm() / expected.double().norm())


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a.double().flatten(), b.double().flatten(), dim=0))


@pytest.fixture
def weight() -> torch.Tensor:
    torch.manual_seed(0)
    return (torch.randn(VOCAB, WIDTH) / WIDTH ** 0.5).bfloat16()


def test_each_gemm_is_the_one_of_its_quantized_operands(weight):
    head = Fp8LMHead(weight)
    hidden = torch.randn(ROWS, WIDTH).bfloat16()
    rows, row_scale = quantize_rows(hidden)
    w8, w_scale = quantize_rows(weight)
    expected = (rows.float() * row_scale) @ (w8.float() * w_scale).T
    torch.testing.assert_close(head.logits(hidden).float(), expected, rtol=2e-2, atol=1e-2)
    grad = torch.softmax(hidden.float() @ weight.float().T, dim=-1).bfloat16()
    g8, g_scale = quantize_rows(grad, GRAD_FP8)
    wt8, wt_scale = quantize_rows(weight.t())
    expected = (g8.float() * g_scale) @ (wt8.float() * wt_scale).T
    torch.testing.assert_close(head.grad_input(grad).float(), expected, rtol=2e-2, atol=1e-3)
    assert head.logits_weight.dtype == head.grad_weight_t.dtype == FP8 and head.grad_weight_t.shape == (WIDTH, VOCAB)


def test_the_gemms_stay_close_to_bf16_and_the_module_itself_is_the_exact_head(weight):
    head = Fp8LMHead(weight)
    hidden = torch.randn(ROWS, WIDTH).bfloat16()
    exact = hidden.float() @ weight.float().T
    assert _relative_error(head.logits(hidden), exact) < 0.06
    grad = torch.softmax(exact, dim=-1)
    grad[torch.arange(ROWS), torch.randint(0, VOCAB, (ROWS,))] -= 1.0
    assert _relative_error(head.grad_input(grad.bfloat16()), grad @ weight.float()) < 0.06
    torch.testing.assert_close(head(hidden), hidden @ weight.T, rtol=0, atol=0)  # labels and drafting: exact
    assert head.weight.data_ptr() == weight.data_ptr()  # the target's tensor, not a copy


def test_the_teachers_labels_are_the_exact_heads_argmax():
    """FP8's top 16 re-scored on the exact rows, ties to the lowest id: the bf16 head's own argmax on every row of a
    random head (whose near-ties are many; FP8's own argmax changes ~8% of them), through teacher_token_ids."""
    from dflash_core.model.loss import teacher_token_ids

    torch.manual_seed(0)
    weight = (torch.randn(8192, 128) / 128 ** 0.5).bfloat16()
    final_hidden = (torch.randn(2, 1024, 128) * 4).bfloat16()
    index = torch.randperm(2048)[:1500]
    norm = torch.nn.Identity()
    head = torch.nn.Linear(128, 8192, bias=False).bfloat16()
    head.weight.data.copy_(weight)
    exact = teacher_token_ids(final_hidden, index_flat=index, final_norm=norm, lm_head=head, chunk_size=512)
    fp8 = Fp8LMHead(weight)
    scored = []
    fp8.logits = lambda rows, logits=fp8.logits: scored.append(len(rows)) or logits(rows)  # the FP8 GEMM ran
    assert torch.equal(teacher_token_ids(final_hidden, index_flat=index, final_norm=norm, lm_head=fp8, chunk_size=512),
                       exact)
    assert scored == [512, 512, 476]
    rows = final_hidden.reshape(-1, 128)[index]
    assert (fp8.logits(rows).argmax(-1) != exact).float().mean() > 0.02  # the re-scoring is what makes them equal


def test_an_unaligned_head_is_refused_by_the_setting_name():
    with pytest.raises(ValueError, match=r"lm_head_fp8 needs .* multiples of 16.*\(4008, 64\); set lm_head_fp8: false"):
        Fp8LMHead(torch.randn(4008, 64))


def _dflash2(hidden, weight, selector, labels, fp8_head):
    hidden = hidden.detach().requires_grad_(True)
    objective = dflash2_objective(hidden, lm_head_weight=weight, selector=selector, labels_N=labels,
                                  predecessor_ids_N=labels.roll(1), token_weights_N=torch.ones(ROWS),
                                  chunk_size=128, dpace_alpha=0.5, num_slots=8, fp8_head=fp8_head)
    return objective, torch.autograd.grad(objective.loss, hidden)[0]


def test_dflash2_loss_with_fp8_gemms_stays_close_and_its_gradient_points_the_same_way(weight):
    selector = CandidateSelector(vocab_size=VOCAB, hidden_size=WIDTH, rank=16, top_k=8)
    selector.reset_parameters(std=0.5)
    hidden = torch.randn(ROWS, WIDTH)
    labels = torch.randint(0, VOCAB, (ROWS,))
    labels[::2] = (hidden[::2] @ weight.float().T).argmax(-1)  # half the labels the head already predicts
    exact, exact_grad = _dflash2(hidden, weight, selector, labels, None)
    fp8, fp8_grad = _dflash2(hidden, weight, selector, labels, Fp8LMHead(weight))
    assert abs(float(fp8.loss.detach()) - float(exact.loss.detach())) < 0.02 * float(exact.loss.detach())
    assert float(fp8.loss.detach()) != float(exact.loss.detach())  # the FP8 GEMMs did run
    assert _cosine(fp8_grad, exact_grad) > 0.99
    # the metric's argmax reads the FP8 logits: near-ties of this random head may flip (3.4% measured)
    assert (fp8.unary_correct == exact.unary_correct).float().mean() > 0.95
    assert torch.equal(fp8.label_in_top_k, exact.label_in_top_k)  # the candidates are re-scored exactly


def test_dflash_loss_with_fp8_gemms_stays_close_and_its_gradient_points_the_same_way(weight):
    hidden = torch.randn(ROWS, WIDTH)
    labels = torch.randint(0, VOCAB, (ROWS,))

    def run(fp8_head):
        states = hidden.detach().requires_grad_(True)
        out = chunked_lm_head_loss(states, lm_head_weight=weight, valid_N=torch.ones(ROWS), labels_N=labels,
                                   dpace_alpha=0.5, num_slots=8, chunk_size=128, fp8_head=fp8_head)
        return out.loss, torch.autograd.grad(out.loss, states)[0]

    exact, exact_grad = run(None)
    fp8, fp8_grad = run(Fp8LMHead(weight))
    assert abs(float(fp8) - float(exact)) < 0.02 * float(exact)
    assert float(fp8) != float(exact)  # the FP8 GEMMs did run
    assert _cosine(fp8_grad, exact_grad) > 0.99


def test_the_fp8_copy_must_be_of_the_head_the_loss_is_given(weight):
    with pytest.raises(ValueError, match="fp8_head must be the FP8 copy of this lm_head_weight"):
        chunked_lm_head_loss(torch.randn(16, WIDTH), lm_head_weight=weight, valid_N=torch.ones(16),
                             labels_N=torch.zeros(16, dtype=torch.long), token_weights_N=torch.ones(16),
                             fp8_head=Fp8LMHead(weight.clone()))


@pytest.mark.parametrize("settings", [{"variant": "dflash"}, {"variant": "dflash2", "loss_target": "teacher"},
                                     {"variant": "dflash2", "loss_target": "teacher", "loss_type": "kl"}],
                         ids=["dflash-data", "dflash2-teacher", "dflash2-teacher-kl"])
def test_trainer_trains_with_fp8_lm_head_gemms_and_says_so(tmp_path, capsys, monkeypatch, settings):
    calls = {"logits": 0, "grad_input": 0}
    for name in calls:
        original = getattr(Fp8LMHead, name)

        def counted(self, rows, original=original, name=name):
            calls[name] += 1
            return original(self, rows)

        monkeypatch.setattr(Fp8LMHead, name, counted)
    config = tiny_config(tmp_path, max_steps=3, checkpoint_every=3, lm_head_fp8=True)
    config = config.model_copy(update={"drafter": config.drafter.model_copy(update=settings)})
    trainer = build_trainer(config)
    assert "loss LM-head GEMMs: fp8" in capsys.readouterr().err
    drafter = trainer.drafter
    assert isinstance(drafter.target_heads.lm_head, Fp8LMHead)
    assert not any(isinstance(m, Fp8LMHead) for m in drafter.modules())  # borrowed, never saved with the drafter
    result = trainer.run()
    trainer.close()
    assert result.final_step == 3
    assert calls["logits"] >= 3 and calls["grad_input"] >= 3  # every step's loss went through the FP8 GEMMs
    if settings.get("loss_target") == "teacher" and "loss_type" not in settings:
        assert calls["logits"] >= 6  # and the teacher's labels through FP8's candidates


def test_a_head_with_a_bias_is_refused_by_the_setting_name(tmp_path):
    from dflash_core.model.drafter import TargetHeads

    trainer = build_trainer(tiny_config(tmp_path, max_steps=1))
    drafter = trainer.drafter
    heads = drafter.target_heads
    biased = torch.nn.Linear(heads.lm_head.weight.shape[1], heads.lm_head.weight.shape[0])
    drafter.attach_target(TargetHeads(embed_tokens=heads.embed_tokens, final_norm=heads.final_norm, lm_head=biased))
    with pytest.raises(ValueError, match="lm_head_fp8: the target's LM head has a bias"):
        drafter.use_fp8_lm_head()
    trainer.close()


def test_a_device_without_fp8_gemms_refuses_lm_head_fp8_by_name(tmp_path, monkeypatch):
    monkeypatch.setattr(fp8_module, "supports_fp8", lambda device: f"{device} has compute capability 8.0")
    config = tiny_config(tmp_path, lm_head_fp8=True)
    cpu = TrainDevices(torch.device("cpu"), torch.device("cpu"))
    with pytest.raises(SystemExit, match=r"^error: lm_head_fp8: cpu has compute capability 8.0; set lm_head_fp8: false"):
        refuse_unsupported_fp8(config, cpu)
    refuse_unsupported_fp8(config.model_copy(update={"lm_head_fp8": False}), cpu)


def test_the_planner_counts_the_heads_fp8_copies_on_the_drafters_gpu():
    from dflash_core.planner import PRESETS, PlanInputs, plan

    shape = PRESETS["qwen3-8b"]
    without, with_copies = (plan(PlanInputs(target=shape, samples=1, mean_tokens=2000, lm_head_fp8=flag))
                            for flag in (False, True))
    assert with_copies.lm_head_fp8_bytes == 2 * 151936 * 4096 and without.lm_head_fp8_bytes == 0
    grown = [b.peak_bytes_per_gpu - a.peak_bytes_per_gpu for a, b in zip(without.layouts, with_copies.layouts)]
    assert with_copies.lm_head_fp8_bytes in grown  # the colocated GPU holds them
