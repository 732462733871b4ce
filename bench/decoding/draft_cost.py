"""Draft cost per round: DFlash's block argmax against DFlash 2's selector walk, same backbone. One round = one
`draft_tokens` call over a cached context (what the evaluator and a serving engine run between two verify
passes), on random weights of a real target's shape (the selector's cost does not depend on the weights). Prints
a table (ms per round, median of --rounds after warmup) and the command.

    python -m bench.decoding.draft_cost                                   (SmolLM2-135M shape, 2 layers, B=8)
    python -m bench.decoding.draft_cost --shape qwen3-8b --layers 5 --block 16 --context 512
    python -m bench.decoding.draft_cost --taps 5              (the context projection over 5 tapped layers)
    python -m bench.decoding.draft_cost --shape qwen3-8b --layers 5 --block 16 --device cuda --dtype bfloat16
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
import warnings

import torch

from dflash_core.model import DFlashConfig
from dflash_core.model.build import build_drafter
from dflash_core.model.dflash2 import drafter_config, draft_tokens
from dflash_core.model.drafter import TargetHeads
from dflash_core.target import real_shape_config


def _smollm2_config():
    import transformers

    return transformers.LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                                    num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                                    tie_word_embeddings=True, rope_theta=100000.0)


def _heads(config, *, device, dtype) -> TargetHeads:
    from dflash_core.model.attention import RMSNorm

    embed = torch.nn.Embedding(config.vocab_size, config.hidden_size, device=device, dtype=dtype)
    lm_head = torch.nn.Linear(config.hidden_size, config.vocab_size, bias=False, device=device, dtype=dtype)
    norm = RMSNorm(config.hidden_size, eps=1e-6, device=device).to(dtype)
    return TargetHeads(embed_tokens=embed, final_norm=norm, lm_head=lm_head)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def time_variant(variant: str, base: DFlashConfig, target_config, args, device, dtype) -> float:
    torch.manual_seed(0)
    drafter = build_drafter(drafter_config(variant, base), device=device).to(dtype).eval()
    drafter.attach_target(_heads(target_config, device=device, dtype=dtype))
    cache = drafter.new_cache()
    width = base.num_tapped_layers * base.hidden_size
    drafter.extend_context(cache, target_hidden=torch.randn(1, args.context, width, device=device, dtype=dtype),
                           position_ids=torch.arange(args.context, device=device)[None])
    last = torch.tensor([11], device=device)
    position = torch.tensor([args.context], device=device)
    times = []
    for round_index in range(args.warmup + args.rounds):
        _sync(device)
        start = time.perf_counter()
        draft_tokens(drafter, cache, last_token_ids=last, position_ids=position)
        _sync(device)
        if round_index >= args.warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=["smollm2-135m", "qwen3-8b"], default="smollm2-135m")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--taps", type=int, default=None,
                        help="tapped target layers (default: the library's, at least 5)")
    parser.add_argument("--intermediate-size", type=int, default=None,
                        help="the drafter's MLP width (drafter.intermediate_size; default: the target's)")
    parser.add_argument("--block", type=int, default=8)
    parser.add_argument("--context", type=int, default=256, help="cached context tokens")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    target_config = _smollm2_config() if args.shape == "smollm2-135m" else real_shape_config(args.shape)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        base = DFlashConfig.from_target(target_config, num_layers=args.layers, block_size=args.block,
                                        num_tapped_layers=args.taps, mask_token_id=0)
    if args.intermediate_size:
        base = dataclasses.replace(base, intermediate_size=args.intermediate_size)
    rows = [(variant, time_variant(variant, base, target_config, args, device, dtype))
            for variant in ("dflash", "dflash2")]
    print(f"\n{args.shape} shape, {args.layers} drafter layers ({base.num_tapped_layers} taps, MLP "
          f"{base.intermediate_size}), B={args.block}, {args.context}-token context, "
          f"{args.device} {args.dtype}, median of {args.rounds} rounds\n")
    print("| variant | ms per round | vs DFlash |\n|---|---:|---:|")
    for variant, ms in rows:
        print(f"| {variant} | {ms:.2f} | {ms / rows[0][1]:.2f}x |")
    print(f"\nreproduce: python -m bench.decoding.draft_cost {' '.join(sys.argv[1:])}".rstrip())


if __name__ == "__main__":
    main()
