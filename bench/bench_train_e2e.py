"""The real training loop end to end (dflash_core.train.loop.Trainer): packing, anchor plans, the
target forward over packed rows (flex_attention, documents from position ids), the drafter step,
AdamW, metrics, on synthetic tokenized data and a random-weight target of a real shape.

This times what a run does, host work included, where bench_train_step.py times the GPU step alone.

H200:      python3 bench/bench_train_e2e.py                 (random:qwen3-8b, 8,192-token rows)
           python3 bench/bench_train_e2e.py --variant dflash2   (the same step for a DFlash 2 drafter)
CPU smoke: .venv/bin/python bench/bench_train_e2e.py --tiny [--variant dflash2]

`--variant dflash2` trains a DFlash 2 drafter (conv around every sublayer, candidate selector with the
published defaults: kernel 2, group 16, rank 256, top-K 16) at the same shape; its row adds the
selector's own acceptance length next to the unary argmax's.

Measured on one H200 (torch 2.11, transformers 5.17), Qwen3-8B-shaped random target, 4 samples of
2,048 tokens packed per row, 512 anchors per row, B=16, 5 layers, teacher = target argmax, metrics
synced every step (log_every=1):
  compile drafter + target layers:  376 ms/step, 21.8K tokens/s, peak 38.6 GiB
  compile drafter only:             431 ms/step, 19.0K tokens/s, peak 38.6 GiB
(field: ~462 ms, 17.7K tokens/s; the GPU-only step in bench_train_step.py: 349 ms, 23.4K.)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dflash_core.train.config import TrainConfig  # noqa: E402
from dflash_core.train.data import TokenizedCorpus  # noqa: E402
from dflash_core.train.loop import Trainer  # noqa: E402


def synthetic_corpus(*, num_samples: int, length: int, vocab: int, seed: int = 0) -> TokenizedCorpus:
    """Samples of `length` random tokens; the first eighth is prompt (no loss)."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(1, vocab, size=num_samples * length, dtype=np.uint32)
    mask = np.tile(np.r_[np.zeros(length // 8, np.uint8), np.ones(length - length // 8, np.uint8)], num_samples)
    offsets = np.arange(num_samples + 1, dtype=np.int64) * length
    return TokenizedCorpus(tokens=tokens, loss_mask=mask, offsets=offsets, names=("synthetic",))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="CPU smoke run (tiny:qwen3 target, short rows)")
    parser.add_argument("--target", default="random:qwen3-8b")
    parser.add_argument("--token-budget", type=int, default=8192)
    parser.add_argument("--sample-len", type=int, default=2048)
    parser.add_argument("--anchors", type=int, default=512, help="anchors per packed row (128 per 2,048 tokens)")
    parser.add_argument("--layers", type=int, default=5)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--teacher", choices=["teacher", "data"], default="teacher")
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--variant", choices=["dflash", "dflash2"], default="dflash",
                        help="drafter variant (drafter.variant in the run config)")
    args = parser.parse_args()
    if args.tiny:
        args.target, args.token_budget, args.sample_len, args.anchors = "tiny:qwen3", 256, 64, 16
        args.layers, args.block_size, args.warmup, args.steps = 1, 8, 1, 3
    cuda = torch.cuda.is_available() and not args.tiny
    vocab = 151936 if args.target == "random:qwen3-8b" else 256
    corpus = synthetic_corpus(num_samples=(args.warmup + args.steps + 2) * args.token_budget // args.sample_len,
                              length=args.sample_len, vocab=vocab)
    config = TrainConfig(
        run_name="bench-e2e", target=args.target, data=["synthetic"], output_dir=Path(tempfile.mkdtemp()),
        token_budget=args.token_budget, max_steps=args.warmup + args.steps, log_every=1, upload_checkpoints=False,
        compile=cuda and not args.no_compile, validate_capture_batches=1,
        drafter={"num_layers": args.layers, "block_size": args.block_size, "num_anchors": args.anchors,
                 "loss_target": args.teacher, "variant": args.variant},
    )
    started = time.perf_counter()
    trainer = Trainer(config, corpus=corpus)
    trainer.save = lambda: None  # time training, not checkpoint writes
    setup_s = time.perf_counter() - started
    trainer.validate_capture()
    stamps: list[float] = []
    records: list[dict] = []

    def on_log(record: dict) -> None:
        stamps.append(time.perf_counter())
        records.append(record)

    trainer.run(on_log=on_log)
    step_ms = [1e3 * (b - a) for a, b in zip(stamps[args.warmup - 1:], stamps[args.warmup:])]
    median_ms = statistics.median(step_ms)
    real_tokens = args.token_budget  # every row is full: samples tile the budget exactly
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan")
    selector_tau = records[-1].get("selector_acceptance_length", float("nan"))  # DFlash 2 only
    print(f"{'target':<18}{'variant':<9}{'tokens/row':>11}{'anchors':>8}{'ms/step':>9}{'tokens/s':>10}"
          f"{'peak GiB':>9}{'loss':>8}{'tau':>7}{'sel tau':>8}{'setup s':>8}")
    print(f"{args.target:<18}{args.variant:<9}{args.token_budget:>11}{args.anchors:>8}{median_ms:>9.1f}"
          f"{real_tokens / median_ms * 1e3:>10,.0f}{peak:>9.1f}{records[-1]['loss']:>8.3f}"
          f"{records[-1]['acceptance_length']:>7.3f}{selector_tau:>8.3f}{setup_s:>8.1f}")
    print(f"drafter parameters: {sum(p.numel() for p in trainer.drafter.parameters()):,}")
    print(f"per-step ms after warmup: {[round(x) for x in step_ms]}")
    print("reproduce: python3 bench/bench_train_e2e.py " + " ".join(sys.argv[1:]))
    trainer.close()


if __name__ == "__main__":
    main()
