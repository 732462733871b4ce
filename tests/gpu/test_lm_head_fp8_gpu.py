"""The drafter loss's LM-head GEMMs in FP8 on CUDA (dflash_core.model.lm_head_fp8.Fp8LMHead, TrainConfig.lm_head_fp8): with
the compiled per-chunk kernels training runs, DFlash 2's loss stays within 1% of bf16's and its input gradient
points the same way, at a real vocabulary, and the teacher's labels stay the bf16 head's argmax. Skipped without a
GPU of compute capability >= 9.0.

Run (H100/H200): python3 -m pytest tests/gpu/test_lm_head_fp8_gpu.py -q
(on a machine without pydantic add --noconftest: the shared conftest imports the settings)
"""

import pytest
import torch

from dflash_core.fp8.target import supports_fp8
from dflash_core.model.lm_head_fp8 import Fp8LMHead
from dflash_core.model.dflash2 import CandidateSelector
from dflash_core.model.dflash2_loss import dflash2_objective

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or supports_fp8(torch.device("cuda")) is not None,
                                reason="needs a GPU of compute capability >= 9.0")

ROWS, WIDTH, VOCAB = 4096, 1024, 151936  # Qwen3's vocabulary: 16-aligned, and not a power of two


def _objective(hidden, weight, selector, labels, fp8_head):
    hidden = hidden.detach().requires_grad_(True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        objective = dflash2_objective(hidden, lm_head_weight=weight, selector=selector, labels_N=labels,
                                      predecessor_ids_N=labels.roll(1), token_weights_N=torch.ones_like(hidden[:, 0]),
                                      chunk_size=2048, dpace_alpha=0.5, num_slots=16, compiled=True,
                                      fp8_head=fp8_head)
    return objective.loss.detach(), torch.autograd.grad(objective.loss, hidden)[0]


def test_compiled_dflash2_loss_with_fp8_gemms_stays_close_to_bf16():
    torch.manual_seed(0)
    weight = (torch.randn(VOCAB, WIDTH, device="cuda") / WIDTH ** 0.5).bfloat16()
    selector = CandidateSelector(vocab_size=VOCAB, hidden_size=WIDTH, rank=32, top_k=16).cuda()
    selector.reset_parameters(std=0.5)
    hidden = torch.randn(ROWS, WIDTH, device="cuda")
    labels = torch.randint(0, VOCAB, (ROWS,), device="cuda")
    labels[::2] = (hidden[::2].bfloat16() @ weight.T).argmax(-1)
    exact, exact_grad = _objective(hidden, weight, selector, labels, None)
    fp8, fp8_grad = _objective(hidden, weight, selector, labels, Fp8LMHead(weight))
    assert abs(float(fp8) - float(exact)) < 0.01 * float(exact)
    cosine = torch.nn.functional.cosine_similarity(fp8_grad.double().flatten(), exact_grad.double().flatten(), dim=0)
    assert float(cosine) > 0.99


def test_the_teachers_labels_match_the_bf16_heads_argmax_on_cuda():
    """cuBLAS may sum a bf16 GEMM in another order than the re-scoring's batched GEMM, so a rounding can differ:
    at most 1 label in 10,000 may change."""
    torch.manual_seed(0)
    weight = (torch.randn(VOCAB, WIDTH, device="cuda") / WIDTH ** 0.5).bfloat16()
    rows = (torch.randn(8192, WIDTH, device="cuda") * 4).bfloat16()
    exact = (rows @ weight.T).argmax(-1)
    changed = int((Fp8LMHead(weight).argmax(rows) != exact).sum())
    assert changed <= 1, f"{changed} of 8,192 labels changed"
