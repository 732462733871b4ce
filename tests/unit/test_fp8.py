"""FP8 target GEMMs (dflash_core.fp8.target, TrainConfig.target_fp8): the scales are wired the right way
round, the quantized target stays close to its own dtype, what must not change does not, and the
trainer trains on it. CPU runs torch._scaled_mm too, so all of this runs here.

Run: .venv/bin/python -m pytest tests/unit/test_fp8.py -q
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dflash_core.fp8 import target as fp8_module
from dflash_core.fp8.target import FP8, Fp8Linear, quantize_linears, quantize_rows, supports_fp8
from dflash_core.planner import PRESETS, ModelShape, PlanInputs, plan
from dflash_core.target import (
    HiddenStateCapture, build_target, language_model, tiny_target_config,
)
from dflash_core.target.runtime import quantize_decoder_layers_fp8
from dflash_core.train.checkpoint import load_checkpoint
from dflash_core.train.entry import refuse_unsupported_fp8
from dflash_core.train.assemble import build_trainer
from dflash_core.train.devices import TrainDevices
from tests.unit.test_trainer import tiny_config

CPU = TrainDevices(torch.device("cpu"), torch.device("cpu"))


def _relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual.double() - expected.double()).norm() / expected.double().norm())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_linear_is_the_gemm_of_its_quantized_operands(dtype):
    torch.manual_seed(0)
    linear = nn.Linear(64, 48, bias=True).to(dtype)
    x = torch.randn(3, 7, 64, dtype=dtype) * torch.linspace(0.01, 100, 7)[None, :, None].to(dtype)  # rows far apart
    fp8 = Fp8Linear(linear)
    with torch.no_grad():
        got = fp8(x)
        x_fp8, x_scale = quantize_rows(x.reshape(-1, 64))
        w_fp8, w_scale = quantize_rows(linear.weight)
        want = (x_fp8.double() * x_scale.double()) @ (w_fp8.double() * w_scale.double()).T + linear.bias.double()
        assert got.dtype == dtype and got.shape == (3, 7, 48)
        assert _relative_error(got.reshape(-1, 48), want) < (1e-6 if dtype == torch.float32 else 1e-2)
        assert _relative_error(got, linear(x)) < 0.06  # e4m3: 3 mantissa bits


def test_fp8_linear_takes_a_transposed_input():
    torch.manual_seed(0)
    linear = nn.Linear(32, 16, bias=False)
    x = torch.randn(32, 5).t()  # [5, 32] with column-major strides: reshape keeps the view
    assert quantize_rows(x)[0].is_contiguous()  # CUDA's FP8 GEMM takes its first operand row-major only
    with torch.no_grad():
        torch.testing.assert_close(Fp8Linear(linear)(x), Fp8Linear(linear)(x.contiguous()), atol=0, rtol=0)


def test_a_dtype_change_leaves_the_quantization_alone_and_empty_inputs_work():
    fp8 = Fp8Linear(nn.Linear(32, 64, bias=False))
    x = torch.randn(4, 32)
    before = fp8(x)
    fp8.half().to(torch.bfloat16).float()
    assert (fp8.weight_fp8.dtype, fp8.weight_scale.dtype) == (FP8, torch.float32)
    torch.testing.assert_close(fp8(x), before, atol=0, rtol=0)
    assert fp8(torch.randn(2, 0, 32)).shape == (2, 0, 64)


def test_quantize_rows_scales_each_row_to_the_fp8_range():
    x = torch.tensor([[1.0, -2.0, 0.5], [0.0, 0.0, 0.0], [1e-3, 3e-3, -1e-3]])
    x_fp8, scale = quantize_rows(x)
    assert x_fp8.dtype == FP8 and scale.shape == (3, 1)
    assert x_fp8.float().abs().amax(dim=1).tolist() == [448.0, 0.0, 448.0]  # an all-zero row stays zero
    torch.testing.assert_close(x_fp8.float() * scale, x, rtol=0.07, atol=0)


def test_only_aligned_linears_that_are_not_narrow_are_quantized():
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Sequential(nn.Linear(64, 48), nn.Linear(48, 4)),
                          nn.Linear(5120, 48), nn.Linear(5120, 256))  # a 27B GDN gate projection; a wide one
    assert quantize_linears(model) == (2, 3)
    assert [type(m).__name__ for m in (model[0], model[2][0], model[2][1], model[3], model[4])] == [
        "Fp8Linear", "Linear", "Linear", "Linear", "Fp8Linear"]
    assert not any(p.dtype == FP8 for p in model.parameters())  # FP8 weights are buffers: no optimizer sees them


def test_each_replaced_linear_is_freed_as_the_next_is_quantized(monkeypatch):
    """The peak of quantizing is one bf16 linear on top of the FP8 copies, not the whole bf16 target."""
    import weakref

    layers = nn.ModuleList(nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64)) for _ in range(4))
    originals = [weakref.ref(m) for m in layers.modules() if type(m) is nn.Linear]
    alive_at_each_quantization = []

    class CountingFp8Linear(Fp8Linear):
        def __init__(self, linear, **options):
            alive_at_each_quantization.append(sum(ref() is not None for ref in originals))
            super().__init__(linear, **options)

    monkeypatch.setattr(fp8_module, "Fp8Linear", CountingFp8Linear)
    assert quantize_linears(layers) == (8, 0)
    # linears still in the model (not yet replaced) + the one being quantized and its sibling in hand
    assert alive_at_each_quantization == [8 - i + (i % 2) for i in range(8)]
    assert all(ref() is None for ref in originals)


@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen3_5"])
def test_quantized_target_keeps_its_heads_and_stays_close(family):
    torch.manual_seed(0)
    # the usual init range (0.02): tiny_target_config's default 0.1 makes a chaotic random model that
    # amplifies any rounding (12-36% apart at its last layer, the same for any 3.5%-per-GEMM change)
    target = build_target(tiny_target_config(family, num_layers=4, hidden_size=64, initializer_range=0.02))
    heads_before = {name: param.clone() for name, param in target.named_parameters()
                    if "embed_tokens" in name or "lm_head" in name or name.endswith("model.norm.weight")}
    input_ids = torch.randint(1, 256, (2, 40))
    reference = HiddenStateCapture(target, layer_ids=[0, 2], capture_final=True)(input_ids)
    quantized, kept = quantize_decoder_layers_fp8(target)
    assert quantized > 0
    if family == "qwen3_5":
        assert kept > 0  # its GDN layers' beta / decay projections (4 wide here) keep their dtype
    got = HiddenStateCapture(target, layer_ids=[0, 2], capture_final=True)(input_ids)
    assert _relative_error(got.tapped_hidden, reference.tapped_hidden) < 0.1
    assert _relative_error(got.final_hidden, reference.final_hidden) < 0.1
    after = dict(target.named_parameters())
    for name, before in heads_before.items():
        assert torch.equal(after[name], before), name
    assert type(target.get_output_embeddings()) is nn.Linear
    assert all(type(m) is not nn.Linear or m.out_features % 16 or m.in_features % 16 or m.out_features < m.in_features
               for m in language_model(target).layers.modules())


def test_trainer_trains_on_an_fp8_target_and_says_so(tmp_path, capsys):
    trainer = build_trainer(tiny_config(tmp_path, max_steps=2, checkpoint_every=2, target_fp8=True))
    assert "target GEMMs: fp8" in capsys.readouterr().err
    assert any(isinstance(m, Fp8Linear) for m in trainer.target.modules())
    assert not any(isinstance(m, Fp8Linear) for m in trainer.drafter.modules())
    result = trainer.run()
    trainer.close()
    assert result.final_step == 2
    assert load_checkpoint(result.checkpoint)[2]["config"]["target_fp8"] is True  # the run says what it trained on


def test_resuming_with_the_other_target_precision_warns(tmp_path):
    first = build_trainer(tiny_config(tmp_path, max_steps=2, checkpoint_every=2))
    first.run()
    first.close()
    again = build_trainer(tiny_config(tmp_path, max_steps=4, checkpoint_every=2, target_fp8=True))
    with pytest.warns(UserWarning, match="trained with target_fp8=False"):
        assert again.resume()
    again.close()


def test_a_device_without_fp8_gemms_is_refused_by_name_before_the_target_loads(tmp_path, monkeypatch):
    assert supports_fp8(torch.device("cpu")) is None
    assert "meta" in supports_fp8(torch.device("meta"))
    monkeypatch.setattr(fp8_module, "supports_fp8", lambda device: f"{device} has compute capability 8.0")
    config = tiny_config(tmp_path, target_fp8=True)
    with pytest.raises(SystemExit, match=r"^error: target_fp8: cpu has compute capability 8.0; set target_fp8: false"):
        refuse_unsupported_fp8(config, CPU)
    refuse_unsupported_fp8(config.model_copy(update={"target_fp8": False}), CPU)


@pytest.mark.parametrize("preset", ["qwen3-8b", "smollm2-135m"])  # untied and tied embeddings
def test_planner_counts_fp8_decoder_weights_at_one_byte(preset):
    shape = PRESETS[preset]
    bf16, fp8 = (plan(PlanInputs(target=shape, samples=1, mean_tokens=2000, target_fp8=flag)).target_weight_bytes
                 for flag in (False, True))
    embedding_rows = shape.vocab_size * (1 if shape.tie_word_embeddings else 2)
    assert bf16 - fp8 == shape.params() - embedding_rows * shape.hidden_size


def test_planner_without_a_vocabulary_counts_no_fp8_saving():
    shape = PRESETS["qwen3-8b"].model_copy(update={"vocab_size": None, "num_params": 8_000_000_000})
    bf16, fp8 = (plan(PlanInputs(target=shape, samples=1, mean_tokens=2000, target_fp8=flag)).target_weight_bytes
                 for flag in (False, True))
    assert bf16 == fp8  # the embedding can't be told apart: nothing is assumed to shrink


def test_planner_peak_covers_the_whole_target_loading_before_it_is_quantized():
    # a deep narrow target: its FP8 layers + drafter + activations fit 26 GiB (23.6); its bf16 load
    # (23.7 GiB of weights + the drafter's + the reserve: 29.0) does not
    deep = ModelShape(num_layers=200, hidden_size=2048, intermediate_size=8192, num_attention_heads=16,
                      num_key_value_heads=8, head_dim=128, vocab_size=32000)
    inputs = dict(target=deep, samples=1, mean_tokens=2000, token_budget=1024, gpu_memory_gib=26.0)
    full_weights = plan(PlanInputs(**inputs)).target_weight_bytes
    colocated = plan(PlanInputs(**inputs, target_fp8=True)).layouts[0]
    assert colocated.layout == "colocated"
    assert colocated.peak_bytes_per_gpu > full_weights + 4 * 2**30
    assert colocated.fits is False


def test_planner_suggests_fp8_where_only_fp8_fits():
    inputs = dict(target=PRESETS["qwen3.5-27b"], samples=1, mean_tokens=2000, num_gpus=2)
    squeezed = {v.layout: v for v in plan(PlanInputs(**inputs, gpu_memory_gib=110.0)).layouts}
    assert squeezed["colocated"].fits is False
    assert "or set target_fp8: true" in squeezed["colocated"].note
    assert "target_fp8" not in squeezed["pair"].note  # fits as it is
    too_small = plan(PlanInputs(**inputs, gpu_memory_gib=80.0)).layouts[0]
    assert too_small.fits is False and "target_fp8" not in too_small.note  # FP8 would not fit either
    already = plan(PlanInputs(**inputs, gpu_memory_gib=90.0, target_fp8=True)).layouts[0]
    assert already.fits is False and "target_fp8" not in already.note


def test_planner_takes_the_measured_drafter_fp8_saving_off_the_peaks():
    inputs = dict(target=PRESETS["qwen3.5-27b"], samples=1, mean_tokens=2000, num_gpus=2, target_fp8=True)
    bf16, fp8 = (plan(PlanInputs(**inputs, drafter_fp8=flag)) for flag in (False, True))
    assert bf16.drafter_fp8_saved_bytes == 0
    # 3.5 bytes per linear parameter of the 1.90B in the 5-layer DFlash 2 drafter of this shape
    assert fp8.drafter_fp8_saved_bytes == pytest.approx(1.90e9 * 3.5, rel=0.01)
    for before, after in zip(bf16.layouts, fp8.layouts):
        assert before.peak_bytes_per_gpu - after.peak_bytes_per_gpu == fp8.drafter_fp8_saved_bytes
    assert fp8.drafter_state_bytes == bf16.drafter_state_bytes  # fp32 masters and AdamW state as before
    # a tiny batch on a wide drafter: the saving never takes the drafter below its own activations' floor
    tiny = plan(PlanInputs(**inputs, drafter_fp8=True, token_budget=16, anchors_per_1k_tokens=64))
    assert tiny.drafter_fp8_saved_bytes == tiny.drafter_activation_bytes


def test_planner_says_which_fp8_options_make_a_27b_fit():
    inputs = dict(target=PRESETS["qwen3.5-27b"], samples=1, mean_tokens=2000, gpu_memory_gib=98.0)
    neither_alone = plan(PlanInputs(**inputs)).layouts[0]  # target FP8 alone: 101.5 GiB, drafter alone: 118
    assert neither_alone.fits is False
    assert "or set target_fp8: true (FP8 target GEMMs, compute capability >= 9.0) and drafter_fp8: true" \
        in neither_alone.note
    with_target_fp8 = plan(PlanInputs(**inputs, target_fp8=True)).layouts[0]
    assert with_target_fp8.fits is False and "or set drafter_fp8: true" in with_target_fp8.note
    assert "target_fp8" not in with_target_fp8.note
    assert plan(PlanInputs(**inputs, target_fp8=True, drafter_fp8=True)).layouts[0].fits


def test_fast_accum_reaches_every_quantized_gemm(monkeypatch):
    layers = nn.Sequential(nn.Linear(64, 256), nn.Linear(256, 256))
    x = torch.randn(5, 64)
    exact = nn.Sequential(*(Fp8Linear(layer) for layer in layers))(x)
    calls = []
    real_scaled_mm = torch._scaled_mm

    def recording_scaled_mm(*args, **kwargs):
        calls.append(kwargs.get("use_fast_accum"))
        return real_scaled_mm(*args, **kwargs)

    monkeypatch.setattr(torch, "_scaled_mm", recording_scaled_mm)
    assert quantize_linears(layers, fast_accum=True) == (2, 0)
    fast = layers(x)
    assert calls == [True, True]
    assert all("fast_accum" in repr(layer) for layer in layers)
    torch.testing.assert_close(fast, exact, rtol=0.05, atol=0.05)
