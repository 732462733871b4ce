"""Tokenized shards built in code for trainer tests (tiny vocab, learnable structure)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa

from dflash_core.data.verdict import GateVerdict
from dflash_core.tokenize.io import arrow_bytes

# Built here to be learnable, never from completions: its quality-gate verdict is part of the shard.
SYNTHETIC_VERDICT = GateVerdict(verdict="passed", note="synthetic test data").arrow_metadata()


def synthetic_shard(path: Path, *, num_samples: int, vocab: int = 256, num_symbols: int = 16, seed: int = 0,
                    min_len: int = 40, max_len: int = 120) -> Path:
    """Samples that follow one fixed successor map (token t is always followed by perm[t]): a prompt
    part (loss 0) then a completion (loss 1). The next tokens are a function of the current one,
    so a drafter can learn them from the anchor alone."""
    rng = np.random.default_rng(seed)
    symbols = np.random.default_rng(1234).choice(np.arange(1, vocab), size=num_symbols, replace=False)
    successor = dict(zip(symbols.tolist(), np.roll(symbols, -3).tolist()))  # token 0 (pad) is never used
    ids, masks = [], []
    for _ in range(num_samples):
        length = int(rng.integers(min_len, max_len))
        tokens = [int(rng.choice(symbols))]
        for _ in range(length - 1):
            tokens.append(successor[tokens[-1]])
        prompt = min(int(rng.integers(5, 15)), length // 2)
        ids.append(tokens)
        masks.append([0] * prompt + [1] * (length - prompt))
    table = pa.table({
        "id": [f"s{i}" for i in range(num_samples)],
        "source": ["synthetic"] * num_samples,
        "input_ids": pa.array(ids, type=pa.list_(pa.uint32())),
        "loss_mask": pa.array(masks, type=pa.list_(pa.uint8())),
        "num_tokens": pa.array([len(x) for x in ids], type=pa.int32()),
        "num_loss_tokens": pa.array([sum(m) for m in masks], type=pa.int32()),
    })
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(arrow_bytes(table, metadata=SYNTHETIC_VERDICT))
    return path
