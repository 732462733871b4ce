"""The drafter's training attention (flex_attention over the block plan's mask), forward + backward,
at a target's attention shape, under backward kernel configs: which one the drafter should ask for.

The mask is the one training builds: a packed 8,192-token row of ShareGPT-like documents (the hybrid
bench's length mix), 512 anchors, blocks of 16; queries = anchors x block, keys = row + blocks.
Default shape: Qwen3.5-27B's attention (24 query heads, 4 KV heads, head_dim 256), the 27B hybrid's
drafter. Each config's gradients are checked against torch's default config (max relative error).

GPU: python3 bench/bench_flex_bwd.py            (one H200: ~1 min, most of it Triton compiling)
CPU smoke (forward only: flex_attention has no CPU backward): .venv/bin/python bench/bench_flex_bwd.py --tiny
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a bare checkout, no install
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_hybrid_step import SHAREGPT_LENGTH_MIX  # noqa: E402

from dflash_core.model.anchors import plan_blocks  # noqa: E402
from dflash_core.model.masks import create_flex_block_mask, flex_attend  # noqa: E402

# (BLOCK_M1, BLOCK_N1, BLOCK_M2, BLOCK_N2, num_stages, num_warps); None: torch's default for the device
CANDIDATES: tuple[tuple[int, ...] | None, ...] = (
    None,
    (64, 64, 64, 64, 1, 4), (64, 64, 64, 64, 1, 8), (64, 64, 64, 64, 2, 8),
    (32, 64, 64, 32, 1, 4), (32, 64, 64, 32, 2, 4), (32, 64, 64, 32, 3, 4),
    (32, 128, 128, 32, 1, 4), (32, 128, 128, 32, 2, 8), (16, 64, 64, 16, 2, 4),
    (64, 128, 128, 64, 1, 8),
)


def kernel_options(candidate: tuple[int, ...] | None) -> dict | None:
    if candidate is None:
        return None
    names = ("bwd_BLOCK_M1", "bwd_BLOCK_N1", "bwd_BLOCK_M2", "bwd_BLOCK_N2", "bwd_num_stages", "bwd_num_warps")
    return dict(zip(names, candidate))


def packed_row(token_budget: int, mean_tokens: float, seed: int) -> torch.Tensor:
    """Position ids of one row packed with documents drawn from the length mix (restarting at 0)."""
    rng = np.random.default_rng(seed)
    positions, filled = [], 0
    while filled < token_budget:
        length = max(2, int(rng.choice(SHAREGPT_LENGTH_MIX) * mean_tokens))
        length = min(length, token_budget - filled)
        positions.append(torch.arange(length))
        filled += length
    return torch.cat(positions)[None]


def time_config(candidate, *, q, k, v, block_mask, steps: int, cuda: bool):
    """Median ms of forward + backward (forward only off CUDA) and the gradients (the output off CUDA)."""
    attend = flex_attend(block_mask, compiled=cuda, kernel_options=kernel_options(candidate))
    grads = None
    times = []
    for step in range(steps + 2):
        for t in (q, k, v):
            t.grad = None
        if cuda:
            torch.cuda.synchronize()
        started = time.perf_counter()
        if cuda:
            attend(q, k, v).float().square().mean().backward()
            torch.cuda.synchronize()
            grads = [t.grad.clone() for t in (q, k, v)]
        else:
            with torch.no_grad():
                grads = [attend(q, k, v)]
        if step >= 2:
            times.append(1e3 * (time.perf_counter() - started))
    return statistics.median(times), grads


def relative_error(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    return max(float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)) for a, b in zip(got, want))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="CPU smoke run: small shapes, two configs")
    parser.add_argument("--heads", type=int, default=24)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=256)
    parser.add_argument("--token-budget", type=int, default=8192)
    parser.add_argument("--anchors", type=int, default=512)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--mean-tokens", type=float, default=2000.0)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available() and not args.tiny
    candidates = CANDIDATES
    if args.tiny:
        args.heads, args.kv_heads, args.head_dim, args.token_budget, args.anchors = 4, 2, 32, 512, 32
        args.mean_tokens, args.steps, candidates = 125.0, 2, CANDIDATES[:2]
    device = torch.device("cuda" if cuda else "cpu")
    for limit in ("cache_size_limit", "recompile_limit"):  # one compile per config, not eager after 8
        if hasattr(torch._dynamo.config, limit):
            setattr(torch._dynamo.config, limit, 64)
    positions = packed_row(args.token_budget, args.mean_tokens, seed=0)
    plan = plan_blocks(loss_mask_BT=torch.ones_like(positions), num_anchors=args.anchors, block_size=args.block_size,
                       position_ids_BT=positions, generator=torch.Generator().manual_seed(0),
                       with_teacher_index=False).to(device)
    block_mask = create_flex_block_mask(plan, compile_mask=cuda)
    q_len = args.anchors * args.block_size
    dtype = torch.bfloat16 if cuda else torch.float32
    generator = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(1, args.heads, q_len, args.head_dim, device=device, dtype=dtype, generator=generator)
    k, v = (torch.randn(1, args.kv_heads, args.token_budget + q_len, args.head_dim, device=device, dtype=dtype,
                        generator=generator) for _ in range(2))
    q, k, v = (t.requires_grad_(cuda) for t in (q, k, v))
    name = torch.cuda.get_device_name() if cuda else "cpu"
    print(f"flex attention fwd+bwd, {name}: q [1, {args.heads}, {q_len}, {args.head_dim}], "
          f"kv [1, {args.kv_heads}, {args.token_budget + q_len}, {args.head_dim}], "
          f"{positions.shape[1]}-token row, {args.anchors} anchors x {args.block_size}")
    print(f"{'bwd config (M1, N1, M2, N2, stages, warps)':<46}{'ms':>9}{'vs default':>12}{'grad rel err':>14}")
    reference = None
    for candidate in candidates:
        try:
            ms, grads = time_config(candidate, q=q, k=k, v=v, block_mask=block_mask, steps=args.steps, cuda=cuda)
        except Exception as error:  # a config the compiler cannot fit (shared memory, registers)
            print(f"{str(candidate or 'default'):<46}  failed: {type(error).__name__}: {str(error)[:80]}")
            continue
        if reference is None:
            reference = (ms, grads)
        err = relative_error(grads, reference[1])
        print(f"{str(candidate or 'default'):<46}{ms:>9.2f}{reference[0] / ms:>11.2f}x{err:>14.1e}")
    print("reproduce: python3 bench/bench_flex_bwd.py" + (" --tiny" if args.tiny else ""))


if __name__ == "__main__":
    main()
