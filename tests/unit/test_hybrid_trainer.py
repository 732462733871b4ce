"""The trainer on a hybrid (Gated DeltaNet) target: packs documents, exactly, and records which
GDN kernels ran.

Run: .venv/bin/python -m pytest tests/unit/test_hybrid_trainer.py -q
"""

from __future__ import annotations

import json

import torch

from dflash_core.train.checkpoint import load_checkpoint
from dflash_core.train.data import collate
from dflash_core.train.assemble import build_trainer
from dflash_core.train.step import batch_tensors, capture_batch
from tests.unit.test_trainer import tiny_config


def test_hybrid_target_packs_exactly_and_records_its_kernels(tmp_path) -> None:
    trainer = build_trainer(tiny_config(tmp_path, target="tiny:qwen3_5", max_steps=2, checkpoint_every=2))
    assert any(len(batch) > 1 for batch in trainer.sampler.epoch_batches(0))
    trainer.validate_capture()  # GDN outputs non-zero and different per document

    packed = batch_tensors(collate(trainer.corpus, [0, 1], token_budget=96), trainer.target_device)
    alone = batch_tensors(collate(trainer.corpus, [1], token_budget=96), trainer.target_device)
    first, second = (int(trainer.corpus.lengths[i]) for i in (0, 1))
    torch.testing.assert_close(capture_batch(trainer.capture, packed).tapped_hidden[0, first:first + second],
                               capture_batch(trainer.capture, alone).tapped_hidden[0, :second], rtol=1e-4, atol=1e-4)

    result = trainer.run()
    trainer.close()
    expected = {"recurrence": "torch", "conv": "torch",
                "transformers_bound": {"chunk_gated_delta_rule": "torch", "causal_conv1d_fn": "torch"}}
    provenance = json.loads((trainer.run_dir / "provenance.json").read_text())
    assert provenance["target_kernels"] == expected
    assert load_checkpoint(result.checkpoint)[2]["target_kernels"] == expected
