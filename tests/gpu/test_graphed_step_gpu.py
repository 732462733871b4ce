"""The training step with its layers replayed as CUDA graphs (TrainConfig.compile_mode
"reduce-overhead") trains like the default compiled step: same losses to bf16 tolerance, step by
step, for DFlash and DFlash 2. Skipped without a GPU.

Run (H100/H200): python3 -m pytest tests/gpu/test_graphed_step_gpu.py -q
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dflash_core.train.assemble import build_trainer
from dflash_core.train.config import TrainConfig
from dflash_core.train.data import TokenizedCorpus

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")

STEPS = 6


def _corpus(*, samples: int = 64, length: int = 256, vocab: int = 256) -> TokenizedCorpus:
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, vocab - 1, size=samples * length, dtype=np.uint32)
    mask = np.tile(np.r_[np.zeros(length // 8, np.uint8), np.ones(length - length // 8, np.uint8)], samples)
    offsets = np.arange(samples + 1, dtype=np.int64) * length
    return TokenizedCorpus(tokens=tokens, loss_mask=mask, offsets=offsets, names=("synthetic",))


def _losses(tmp_path, *, variant: str, mode: str) -> list[float]:
    config = TrainConfig(
        run_name=f"graphs-{variant}-{mode}", target="tiny:qwen3", data=["synthetic"], output_dir=tmp_path / mode,
        token_budget=1024, max_steps=STEPS, log_every=1, upload_checkpoints=False, checkpoint_every=STEPS + 1,
        compile=True, compile_mode=mode, prefetch_batches=0,
        drafter={"num_layers": 2, "block_size": 8, "num_anchors": 64, "variant": variant,
                 **({"selector_rank": 16} if variant == "dflash2" else {})},
    )
    trainer = build_trainer(config, corpus=_corpus())
    trainer.save = lambda: None
    records: list[dict] = []
    try:
        trainer.run(on_log=records.append)
    finally:
        trainer.close()
    return [float(record["loss"]) for record in records]


@pytest.mark.parametrize("variant", ["dflash", "dflash2"])
def test_graphed_step_trains_like_the_compiled_step(tmp_path, variant):
    compiled = _losses(tmp_path, variant=variant, mode="default")
    graphed = _losses(tmp_path, variant=variant, mode="reduce-overhead")
    assert len(graphed) == len(compiled) == STEPS
    assert all(np.isfinite(graphed))
    np.testing.assert_allclose(graphed, compiled, rtol=2e-2)
