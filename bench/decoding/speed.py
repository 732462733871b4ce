"""Speculative decoding speed: tau, tokens/s and speedup over target-only greedy decoding in the same harness
(eager transformers or CUDA graphs), block and DDTree modes, per round the draft, verify and other ms, and whether
each output matches the target's own greedy decoding. On a random-weight target and a random-init drafter the
drafter proposes noise (tau ~1), so the "speedup" is the drafting overhead: it measures the harness, and the
break-even tau (a round's cost in target-only steps) it prints. Give a trained drafter to measure it instead.

    python -m bench.decoding.speed --target tiny:qwen3 --prompts 4 --new-tokens 64                    (CPU smoke)
    python -m bench.decoding.speed --target qwen3-8b --device cuda --prompts 4 --prompt-len 512 --new-tokens 128
    python -m bench.decoding.speed --target MODEL_DIR --checkpoint CKPT --prompts-file heldout-00000.arrow \
        --device cuda --prompt-len 1024 --new-tokens 96 --modes block --prompts 64 --harness eager graphs

Needs torch and transformers only (no pydantic), so it runs on a bare GPU image.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path

import torch

from dflash_core.evaluate import evaluate_prompts
from dflash_core.evaluate.inputs import load_drafter_checkpoint, prompts_from_tokenized
from dflash_core.model import DFlashConfig
from dflash_core.model.build import build_drafter
from dflash_core.target import (
    build_target, build_target_on_device, load_target, target_heads, tiny_target_config,
)


def qwen3_8b_config():
    """Qwen3-8B's shape (36 layers, hidden 4096, GQA 32/8, head_dim 128, vocab 151,936), random weights."""
    import transformers

    return transformers.Qwen3Config(
        hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
        rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False, pad_token_id=None,
    )


def smollm2_135m_config():
    """SmolLM2-135M-Instruct's shape (30 layers, hidden 576, GQA 9/3, vocab 49,152, tied embeddings), random
    weights: the embedded target, the pipeline's one-GPU example."""
    import transformers

    return transformers.LlamaConfig(
        hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
        vocab_size=49152, max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5,
        tie_word_embeddings=True, pad_token_id=None,
    )


def break_even_tau(summary: dict) -> float:
    """The tau at which a round costs as much as the target-only tokens it yields: speedup 1.0x. A round's
    time is what it costs whatever is accepted, so a trained drafter's speedup is about tau / this."""
    split = summary["round_ms"]
    round_ms = split["draft"] + split["verify"] + split["other"]
    return round_ms / split["target_step"] if split["target_step"] else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="tiny:qwen3",
                        help="tiny:<family>, smollm2-135m or qwen3-8b (random weights), or a model dir")
    parser.add_argument("--checkpoint", type=Path, default=None,
                        help="a trained drafter's checkpoint dir (meta.json, model.safetensors) instead of a random one")
    parser.add_argument("--prompts-file", type=Path, default=None,
                        help="a tokenized .arrow shard (e.g. a held-out split) instead of random prompts")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--drafter-layers", type=int, default=5)
    parser.add_argument("--tree-budget", type=int, default=None)
    parser.add_argument("--modes", nargs="+", default=["block", "tree"])
    parser.add_argument("--harness", nargs="+", default=["eager"], choices=["eager", "graphs"],
                        help="one report per harness (graphs: block mode only)")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default=None,
                        help="default: bf16 on GPU, fp32 on CPU")
    parser.add_argument("--json", type=Path, default=None, help="also write the report here")
    args = parser.parse_args()

    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    torch.manual_seed(0)
    start = time.perf_counter()
    if args.target in ("qwen3-8b", "smollm2-135m"):
        target_config = qwen3_8b_config() if args.target == "qwen3-8b" else smollm2_135m_config()
        target = build_target_on_device(target_config, device=device, dtype=dtype)
    elif Path(args.target).is_dir():
        target = load_target(args.target, device=device, dtype=dtype)
        target_config = getattr(target.config, "text_config", None) or target.config
    else:
        target_config = tiny_target_config(args.target.removeprefix("tiny:"), num_layers=8)  # room for 5 taps
        target = build_target(target_config, device=device, dtype=dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = DFlashConfig.from_target(target_config, num_layers=args.drafter_layers, block_size=args.block_size)
    if args.checkpoint is not None:
        drafter = load_drafter_checkpoint(args.checkpoint, device=device).to(dtype)
    else:
        drafter = build_drafter(config, device=device).to(dtype)
    drafter.attach_target(target_heads(target))
    build_s = time.perf_counter() - start
    vocab = getattr(target_config, "vocab_size")
    generator = torch.Generator().manual_seed(1)
    if args.prompts_file is not None:
        prompts = prompts_from_tokenized(args.prompts_file.read_bytes(), num_prompts=args.prompts,
                                         max_prompt_tokens=args.prompt_len)
    else:
        prompts = [torch.randint(0, vocab, (args.prompt_len,), generator=generator).tolist()
                   for _ in range(args.prompts)]
    eos = getattr(target_config, "eos_token_id", None) if args.prompts_file is not None else None
    eos = eos[0] if isinstance(eos, list) else eos
    reports = {}
    for harness in args.harness:
        modes = ("block",) if harness == "graphs" else tuple(args.modes)
        start = time.perf_counter()
        reports[harness] = evaluate_prompts(target=target, drafter=drafter, prompts=prompts, modes=modes,
                                            max_new_tokens=args.new_tokens, tree_budget=args.tree_budget,
                                            harness=harness, eos_token_id=eos)
        reports[harness]["seconds"] = time.perf_counter() - start
    print(f"target {args.target} ({sum(p.numel() for p in target.parameters()) / 1e9:.2f}B params, {dtype}, "
          f"{device}), drafter {len(drafter.layers)} layers B={drafter.config.block_size}, "
          f"{args.checkpoint or 'RANDOM weights'}; built in {build_s:.1f} s")
    print(f"{len(prompts)} prompts of {args.prompts_file or 'random tokens'} (at most {args.prompt_len} tokens), "
          f"{args.new_tokens} new tokens each\n")
    for harness, report in reports.items():
        print(f"harness {harness} ({report['seconds']:.1f} s with set-up and warm-up):")
        print(report["table"])
        for summary in report["summaries"]:
            print(f"  {summary['mode']}: speedup 1.0x at tau {break_even_tau(summary):.2f} (a round costs that many "
                  "target-only steps)")
        print()
    report = {"harnesses": reports}
    if device.type == "cuda":
        print(f"\npeak GPU memory {torch.cuda.max_memory_allocated(device) / 2**30:.1f} GiB")
    print("\nreproduce: python -m bench.decoding.speed " + " ".join(sys.argv[1:]))
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args), **report}, indent=2, default=str))  # paths as text


if __name__ == "__main__":
    main()
