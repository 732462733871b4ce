"""What packing costs the target forward: 4 documents of 2,048 tokens as 4 rows (causal, no mask)
against one packed row of 8,192 with a dense document mask (sdpa), and against what the trainer
does: the packed row with position ids only, flex_attention (transformers builds the document
BlockMask from the position ids). Qwen3-8B-shaped random target, bf16.

H200: python3 bench/bench_packed_capture.py
CPU smoke: .venv/bin/python bench/bench_packed_capture.py --tiny

Measured on one H200 (torch 2.11, transformers 5.17), eager target:
  layout                                 ms   tokens/s  max rel diff vs rows
  4 rows x 2048, causal (sdpa)        257.0     31,879  0
  1 row x 8192, dense doc mask (sdpa) 384.7     21,296  4.1e-02 (bf16 kernel noise)
  1 row x 8192, flex doc mask         260.3     31,477  5.0e-02
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dflash_core.target import HiddenStateCapture, build_target, build_target_on_device, tiny_target_config  # noqa: E402


def packed_causal_mask(document_ids_BT: torch.Tensor) -> torch.Tensor:
    """[B, 1, T, T] boolean (True = attend): causal within each packed document, nothing across."""
    seq_len = document_ids_BT.shape[1]
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool, device=document_ids_BT.device).tril()
    return ((document_ids_BT[:, :, None] == document_ids_BT[:, None, :]) & causal)[:, None]


def timed(fn, *, cuda: bool, repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--docs", type=int, default=4)
    parser.add_argument("--doc-len", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    cuda = torch.cuda.is_available() and not args.tiny
    device = torch.device("cuda" if cuda else "cpu")
    if cuda:
        import transformers

        config = transformers.Qwen3Config(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                                          num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                                          vocab_size=151936, max_position_embeddings=40960)
        target = build_target_on_device(config, device=device, dtype=torch.bfloat16)
    else:
        args.doc_len, args.repeats = 64, 2
        config = tiny_target_config("qwen3")
        target = build_target(config)
    capture = HiddenStateCapture(target, layer_ids=[1, 9, 17, 25, 33] if cuda else [1, 3], capture_final=True)
    ids = torch.randint(1, config.vocab_size, (args.docs, args.doc_len), device=device)
    rows = lambda: capture(ids)  # noqa: E731
    packed_ids = ids.reshape(1, -1)
    positions = torch.arange(args.doc_len, device=device).repeat(args.docs)[None]
    documents = torch.arange(args.docs, device=device).repeat_interleave(args.doc_len)[None]
    mask = packed_causal_mask(documents)
    packed = lambda: capture(packed_ids, position_ids=positions, attention_mask=mask)  # noqa: E731
    tokens = args.docs * args.doc_len
    reference = rows().tapped_hidden.reshape(1, tokens, -1).float()
    layouts = [(f"{args.docs} rows x {args.doc_len}, causal (sdpa)", rows),
               (f"1 row x {tokens}, dense doc mask (sdpa)", packed)]
    if cuda:
        # transformers builds a document BlockMask from packed position ids when no mask is given.
        def flex_packed():
            target.set_attn_implementation("flex_attention")
            try:
                return capture(packed_ids, position_ids=positions)
            finally:
                target.set_attn_implementation("sdpa")
        layouts.append((f"1 row x {tokens}, flex doc mask", flex_packed))
    print(f"{'layout':<40}{'ms':>9}{'tokens/s':>12}{'max rel diff':>14}")
    for name, fn in layouts:
        try:
            states = fn().tapped_hidden.reshape(1, tokens, -1).float()  # also the warm-up
            diff = ((states - reference).abs().max() / reference.abs().max()).item()
            ms = timed(fn, cuda=cuda, repeats=args.repeats)
            print(f"{name:<40}{ms:>9.1f}{tokens / ms * 1e3:>12,.0f}{diff:>14.2e}")
        except Exception as error:  # noqa: BLE001 - report the layout that could not run, keep the others
            print(f"{name:<40} failed: {repr(error)[:200]}")
    print("reproduce: python3 bench/bench_packed_capture.py " + " ".join(sys.argv[1:]))


if __name__ == "__main__":
    main()
