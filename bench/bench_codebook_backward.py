"""The DFlash 2 selector's codebook reads, forward + backward: advanced indexing (`codebook[ids]`,
whose backward sorts the ids and sums each id's rows one after another) against `F.embedding`
(embedding_dense_backward, which splits long runs of one id into parallel partial sums),
at the shapes of a training step: the successor codebook read at N slots x K candidates, the
predecessor codebook at N slots. Prints ms per read (median of --repeats), whether both give the same
gradient, and whether each gives the same gradient twice (deterministic). Then the other gather of
the DFlash 2 loss's backward: the candidate logits' input gradient, sum_k g[n, k] * W[c[n, k]] over the
frozen LM head W, as `einsum` over gathered [N, K, H] rows (what dflash2_loss does) against
`F.embedding_bag(..., per_sample_weights=g, mode="sum")` (no [N, K, H] tensor), per 1,920-row chunk.

    python3 bench/bench_codebook_backward.py                 (one GPU; Qwen3-8B's and Qwen3.5's vocabularies)
    .venv/bin/python bench/bench_codebook_backward.py --tiny (CPU smoke)
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

# (name, vocab, rank, slots N, candidates K): 512 anchors x 15 drafted slots, the published top-K 16.
SHAPES = [("qwen3-8b", 151_936, 256, 7_680, 16), ("qwen3.5-27b", 248_320, 256, 7_680, 16)]
TINY = [("tiny", 4_096, 32, 120, 4)]
READS = {"index": lambda table, ids: table[ids], "embedding": lambda table, ids: F.embedding(ids, table)}


def timed_ms(fn, *, repeats: int, device: torch.device) -> float:
    """Median wall time of `fn` in ms (CUDA events on a GPU)."""
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            began = time.perf_counter()
            fn()
            times.append((time.perf_counter() - began) * 1e3)
    return statistics.median(times)


def _gradient(read, table: torch.Tensor, ids: torch.Tensor, upstream: torch.Tensor) -> torch.Tensor:
    table.grad = None
    read(table, ids).backward(upstream)
    return table.grad.clone()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    device_name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(f"device: {device_name}, torch {torch.__version__}")
    print("| shape | read | ids | ms fwd+bwd | same grad as index | deterministic |")
    print("|---|---|---|---:|---|---|")
    generator = torch.Generator(device=device).manual_seed(0)
    for name, vocab, rank, slots, top_k in TINY if args.tiny else SHAPES:
        table = torch.randn(vocab, rank, device=device, generator=generator).requires_grad_()
        # Candidates are the unary top-K: frequent tokens dominate. "mixed": 70% from 2,000 frequent
        # ids; "repeated": 16 distinct ids, what a random-weight target's top-K gives (bench_train_e2e).
        frequent = torch.randint(0, 2_000, (slots, top_k), device=device, generator=generator)
        rare = torch.randint(0, vocab, (slots, top_k), device=device, generator=generator)
        pick_rare = torch.rand(slots, top_k, device=device, generator=generator) < 0.3
        repeated = torch.randint(0, 16, (slots, top_k), device=device, generator=generator)
        mixed = torch.where(pick_rare, rare, frequent)
        cases = (("N x K mixed", mixed), ("N mixed", frequent[:, 0]),
                 ("N x K repeated", repeated), ("N repeated", repeated[:, 0]))
        for ids_name, ids in cases:
            upstream = torch.randn(*ids.shape, rank, device=device, generator=generator)
            reference = _gradient(READS["index"], table, ids, upstream)
            for read_name, read in READS.items():
                grad = _gradient(read, table, ids, upstream)
                again = _gradient(read, table, ids, upstream)
                same = torch.allclose(grad, reference, rtol=1e-5, atol=1e-5)
                ms = timed_ms(lambda: torch.autograd.grad(read(table, ids), table, upstream),
                            repeats=args.repeats, device=device)
                deterministic = torch.equal(grad, again)
                print(f"| {name} | {read_name} | {ids_name} | {ms:.3f} | {same} | {deterministic} |")
    print()
    print("| shape | candidate-row gradient | ms per chunk | max abs diff vs einsum |")
    print("|---|---|---:|---:|")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    for name, vocab, _, _, top_k in TINY if args.tiny else SHAPES:
        hidden = 64 if args.tiny else (4096 if name == "qwen3-8b" else 5120)
        chunk = 30 if args.tiny else 1_920
        head = torch.randn(vocab, hidden, device=device, generator=generator).to(dtype) * 0.02
        ids = torch.randint(0, vocab, (chunk, top_k), device=device, generator=generator)
        grad = torch.randn(chunk, top_k, device=device, generator=generator).to(dtype)
        ways = {"einsum over gathered rows": lambda: torch.einsum("nk,nkh->nh", grad, head[ids]),
                "embedding_bag": lambda: F.embedding_bag(ids, head, per_sample_weights=grad, mode="sum")}
        reference = ways["einsum over gathered rows"]().float()
        for way, fn in ways.items():
            diff = (fn().float() - reference).abs().max().item()
            print(f"| {name} | {way} | {timed_ms(fn, repeats=args.repeats, device=device):.3f} | {diff:.2e} |")
    print("command: python3 bench/bench_codebook_backward.py")


if __name__ == "__main__":
    main()
