"""FP8 drafter GEMMs in training on CUDA (torchao float8, TrainConfig.drafter_fp8): the drafter's own
linears become Float8Linears (the borrowed LM head does not), a compiled training step of a small
drafter stays close to its bf16 twin, and the parameters stay fp32 masters. Skipped without torchao or
a GPU of compute capability >= 9.0.

Run (H100/H200, torchao installed): python3 -m pytest tests/gpu/test_drafter_fp8_gpu.py -q
(on a machine without pydantic add --noconftest: the shared conftest imports the settings)
"""

import copy

import pytest
import torch
from torch import nn

from dflash_core.fp8.drafter import convert_drafter_linears, supports_drafter_fp8

torchao = pytest.importorskip("torchao")
pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or supports_drafter_fp8(torch.device("cuda"), "rowwise") is not None,
    reason="needs a GPU of compute capability >= 9.0")


class _Block(nn.Module):
    """Widths like a small drafter layer's: two eligible projections and a narrow one kept in bf16."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(256, 1024, bias=False)
        self.down = nn.Linear(1024, 256, bias=False)
        self.gate = nn.Linear(256, 32, bias=False)  # narrow: stays an nn.Linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x))) + self.gate(x).sum(-1, keepdim=True)


@pytest.mark.parametrize("recipe", ["rowwise", "tensorwise"])
def test_a_compiled_fp8_step_stays_close_to_bf16(recipe):
    from torchao.float8.float8_linear import Float8Linear

    torch.manual_seed(0)
    reference = _Block().cuda()
    model = copy.deepcopy(reference)
    assert convert_drafter_linears(model, recipe=recipe) == (2, 1)
    assert isinstance(model.up, Float8Linear) and type(model.gate) is nn.Linear
    assert all(p.dtype == torch.float32 for p in model.parameters())
    compiled = torch.compile(model, dynamic=False)
    x = torch.randn(4096, 256, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        got, want = compiled(x), reference(x)
    got.float().square().mean().backward()
    want.float().square().mean().backward()
    assert float((got.float() - want.float()).norm() / want.float().norm()) < 0.1
    for name in ("up", "down"):
        grad, grad_ref = getattr(model, name).weight.grad, getattr(reference, name).weight.grad
        assert grad.dtype == torch.float32
        assert float((grad - grad_ref).norm() / grad_ref.norm()) < 0.15


def test_the_trainer_converts_the_drafter_not_the_lm_head(tmp_path):
    import math

    import numpy as np

    from dflash_core.train.assemble import build_trainer
    from dflash_core.train.config import TrainConfig
    from dflash_core.train.data import TokenizedCorpus
    from torchao.float8.float8_linear import Float8Linear

    length, samples = 64, 64
    tokens = np.random.default_rng(0).integers(1, 255, size=samples * length, dtype=np.uint32)
    mask = np.tile(np.r_[np.zeros(8, np.uint8), np.ones(length - 8, np.uint8)], samples)
    corpus = TokenizedCorpus(tokens=tokens, loss_mask=mask, offsets=np.arange(samples + 1, dtype=np.int64) * length,
                             names=("synthetic",))
    config = TrainConfig(run_name="fp8", target="tiny:qwen3", data=["synthetic"], output_dir=tmp_path, token_budget=256,
                         max_steps=4, log_every=2, upload_checkpoints=False, checkpoint_every=100,
                         drafter={"num_layers": 1, "block_size": 8, "num_anchors": 16}, drafter_fp8=True,
                         drafter_fp8_recipe="rowwise")
    trainer = build_trainer(config, corpus=corpus)
    drafter = trainer.drafter
    assert any(isinstance(m, Float8Linear) for m in drafter.modules()), "no drafter linear was converted"
    assert not isinstance(drafter.target_heads.lm_head, Float8Linear)
    records = []
    trainer.run(on_log=records.append)
    trainer.close()
    assert records and all(math.isfinite(r["loss"]) for r in records)
