"""The chunked LM-head losses' torch.compile'd per-chunk kernels (what training runs after
`compile_layers`) give the eager kernels' loss, gradients and correctness: DFlash 2's (candidates
too) on CPU and, when there is one, on CUDA at a larger vocabulary; DFlash's on CPU.

Run: `.venv/bin/python -m pytest tests/unit/test_compiled_loss_kernels.py -q`
(CUDA machine without pydantic: python3 -m pytest --noconftest -p no:cacheprovider -k cuda <this file>)
"""

import pytest
import torch

from dflash_core.model.build import build_drafter
from dflash_core.model.dflash2 import CandidateSelector
from dflash_core.model.dflash2_loss import dflash2_objective
from dflash_core.model.loss import chunked_lm_head_loss

SHAPES = {"cpu": (2560, 32, 3000), "cuda": (2560, 256, 32000)}  # rows: 2 full chunks and a short one


def _objective(hidden, weight, selector, labels, predecessors, token_weights, **options):
    hidden = hidden.detach().requires_grad_(True)
    objective = dflash2_objective(hidden, lm_head_weight=weight, selector=selector, labels_N=labels,
                                  predecessor_ids_N=predecessors, token_weights_N=token_weights, chunk_size=1024,
                                  **options)
    grads = torch.autograd.grad(objective.loss, [hidden, *selector.parameters()])
    return objective, grads


@pytest.mark.slow  # torch.compile on a CPU: C++ builds, seconds per variant
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA"))])
@pytest.mark.parametrize("options", [{}, {"output_multiplier": 0.7, "softcap": 30.0},
                                     {"label_smoothing": 0.1, "dpace_alpha": 0.5, "num_slots": 8}])
def test_compiled_unary_kernel_matches_eager(options, device):
    torch.manual_seed(0)
    num, hidden_size, vocab = SHAPES[device]
    weight = (torch.randn(vocab, hidden_size, device=device) / hidden_size ** 0.5).bfloat16()
    selector = CandidateSelector(vocab_size=vocab, hidden_size=hidden_size, rank=16, top_k=8).to(device)
    selector.reset_parameters(std=0.5)  # its parameters start uninitialized (the drafter's init fills them)
    hidden = torch.randn(num, hidden_size, device=device)  # the drafter's fp32 states; the head is bf16
    labels = torch.randint(0, vocab, (num,), device=device)
    labels[::3] = (hidden[::3] @ weight.float().T).argmax(-1)  # some labels the head already predicts
    predecessors = torch.randint(0, vocab, (num,), device=device)
    token_weights = (torch.rand(num, device=device) > 0.1).float()
    args = (hidden, weight, selector, labels, predecessors, token_weights)
    eager, eager_grads = _objective(*args, **options)
    compiled, compiled_grads = _objective(*args, compiled=True, **options)
    torch.testing.assert_close(compiled.loss, eager.loss, rtol=1e-4, atol=1e-5)
    assert torch.equal(compiled.unary_correct, eager.unary_correct)
    assert torch.equal(compiled.label_in_top_k, eager.label_in_top_k)
    for got, want in zip(compiled_grads, eager_grads, strict=True):
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=1e-4)


@pytest.mark.slow  # torch.compile on a CPU
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_compiled_dflash_loss_kernel_matches_eager(smoothing):
    """DFlash's chunked cross-entropy shares the per-row terms with DFlash 2's (cross_entropy_terms)."""
    torch.manual_seed(0)
    num, hidden_size, vocab = 600, 32, 3000
    weight = (torch.randn(vocab, hidden_size) / hidden_size ** 0.5).bfloat16()
    hidden = torch.randn(num, hidden_size)
    labels = torch.randint(0, vocab, (num,))
    valid = torch.rand(num) > 0.1

    def run(compiled: bool):
        states = hidden.clone().requires_grad_(True)
        result = chunked_lm_head_loss(states, lm_head_weight=weight, valid_N=valid, labels_N=labels,
                                      token_weights_N=torch.ones(num), chunk_size=256, label_smoothing=smoothing,
                                      compiled=compiled)
        return result, torch.autograd.grad(result.loss, states)[0]

    eager, eager_grad = run(False)
    compiled, compiled_grad = run(True)
    torch.testing.assert_close(compiled.loss, eager.loss, rtol=1e-4, atol=1e-5)
    assert torch.equal(compiled.correct, eager.correct)
    torch.testing.assert_close(compiled_grad, eager_grad, rtol=2e-2, atol=1e-5)


def test_compile_layers_compiles_only_its_own_drafters_loss():
    """What training runs: `compile_layers` (config.compile) puts that drafter's loss on the compiled
    kernels; another drafter in the process keeps the eager ones (no module-global switch)."""
    from dflash_core.model import DFlashConfig

    config = DFlashConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=8, vocab_size=128, target_layer_ids=[1], mask_token_id=5, block_size=8,
                          num_layers=1)
    compiled, eager = build_drafter(config), build_drafter(config)
    compiled.compile_layers()  # torch.compile is lazy: nothing compiles until a call
    assert compiled._layers_compiled and not eager._layers_compiled


def test_uncompile_layers_brings_a_trained_drafter_back_to_eager():
    """What the acceptance bench does before decoding with a drafter trained compiled (--train-compile)."""
    from dflash_core.model import DFlashConfig

    config = DFlashConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=8, vocab_size=128, target_layer_ids=[1], mask_token_id=5, block_size=8,
                          num_layers=1)
    drafter = build_drafter(config)
    method = type(drafter.layers[0].self_attn).key_value
    drafter.compile_layers(mode="reduce-overhead")  # lazy: nothing compiles
    assert drafter.layers[0]._compiled_call_impl is not None
    drafter.uncompile_layers()
    layer = drafter.layers[0]
    assert layer._compiled_call_impl is None and not drafter._layers_compiled
    assert layer.self_attn.key_value.__func__ is method


def test_a_compiled_drafters_loss_runs_the_compiled_kernels(monkeypatch):
    """The flag `compile_layers` sets reaches the loss: the drafter then asks for the compiled kernels,
    another drafter keeps the eager ones (layers left eager here: CPU compiles are slow)."""
    from dflash_core.model import drafter as drafter_module
    from tests.unit.test_drafter_loss_options import _drafter, _run, _setup

    asked = []
    real = drafter_module.chunked_lm_head_loss

    def recording(*args, compiled=False, **kwargs):
        asked.append(compiled)
        return real(*args, compiled=False, **kwargs)  # the math is the same; the test is the wiring

    monkeypatch.setattr(drafter_module, "chunked_lm_head_loss", recording)
    target, config, input_ids, captured, plan = _setup()
    eager, compiled = _drafter(config, target), _drafter(config, target)
    compiled._layers_compiled = True  # what compile_layers sets (test above)
    _run(eager, input_ids, captured, plan)
    _run(compiled, input_ids, captured, plan)
    assert asked == [False, True]
