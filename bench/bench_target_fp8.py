"""The frozen target's forward in FP8: our hand-written row-wise module (dflash_core.fp8, what
`TrainConfig.target_fp8` uses) against torchao's inference quantization
(`quantize_(layers, Float8DynamicActivationFloat8WeightConfig(granularity=PerRow()))`, the same scheme:
one e4m3 scale per token of the input and per output channel of the weight) and the bf16 target.

Each variant builds the random-weight Qwen3-8B-shaped target afresh (same seed), quantizes the decoder
layers' linears only (the trainer's choice: embedding and LM head as loaded), switches it to flex
attention, compiles its decoder layers as the trainer does (`compile=True`), and times the capture
forward the trainer runs (one packed row of --docs documents, 5 tapped layers + the pre-norm final
state). Error: the tapped states' relative Frobenius error against the bf16 variant's.

2026-12-04, one H200 (torch 2.11, torchao 0.18.0), 4 x 2,048 tokens:
  bf16 202.8 ms; ours (fast accumulation, the default) 130.6 ms; torchao PerRow 130.2 ms; ours with exact
  accumulation 138.0 ms; tapped-state error against bf16 0.470 for all three FP8 rows (a random 36-layer
  target compounds each GEMM's ~3.5%). That call's peak GiB column is not comparable: it ran before
  `torch._dynamo.reset()` between variants, so earlier variants' compiled code kept their targets alive.

H200 (torchao is the `gpu` extra; on an image without it: carry its wheel and unzip it into PYTHONPATH):
  python3 bench/bench_target_fp8.py --json $OUT/target_fp8.json
CPU smoke (tiny target, hand-written only unless torchao is installed): .venv/bin/python bench/bench_target_fp8.py --tiny
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[1])]

from dflash_core.target import HiddenStateCapture, build_target, language_model, tiny_target_config  # noqa: E402
from dflash_core.target_runtime import compile_decoder_layers, quantize_decoder_layers_fp8, use_flex_attention  # noqa: E402
from bench_codebook_backward import timed_ms  # noqa: E402

VARIANTS = ("bf16", "ours", "ours-exact-accum", "torchao")


def build(args, device: torch.device) -> torch.nn.Module:
    torch.manual_seed(0)
    if args.tiny:
        return build_target(tiny_target_config("qwen3", initializer_range=0.02), device=device)
    from dflash_core.target import build_target_on_device, real_shape_config

    return build_target_on_device(real_shape_config("qwen3-8b"), device=device, dtype=torch.bfloat16)


def quantize(target: torch.nn.Module, variant: str) -> None:
    if variant == "ours":
        quantize_decoder_layers_fp8(target, fast_accum=True)
    elif variant == "ours-exact-accum":
        quantize_decoder_layers_fp8(target, fast_accum=False)
    elif variant == "torchao":
        from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow, quantize_

        for layer in language_model(target).layers:  # the decoder layers only, as ours
            quantize_(layer, Float8DynamicActivationFloat8WeightConfig(granularity=PerRow()))


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--docs", type=int, default=4)
    parser.add_argument("--doc-len", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available() and not args.tiny
    device = torch.device("cuda" if cuda else "cpu")
    if args.tiny:
        args.doc_len, args.repeats = 64, 2
    rows, reference = [], None
    generator = torch.Generator().manual_seed(1)
    for variant in args.variants.split(","):
        target = build(args, device)
        vocab = target.config.vocab_size
        ids = torch.randint(1, vocab, (1, args.docs * args.doc_len), generator=generator.manual_seed(1)).to(device)
        positions = torch.arange(args.doc_len, device=device).repeat(args.docs)[None]
        layers = len(language_model(target).layers)
        tapped = sorted({1, layers // 4, layers // 2, 3 * layers // 4, layers - 3})
        try:
            quantize(target, variant)
            if cuda:
                use_flex_attention(target)
                compile_decoder_layers(target)
                torch.cuda.reset_peak_memory_stats()
            capture = HiddenStateCapture(target, layer_ids=tapped, capture_final=True)

            def forward():
                with torch.no_grad():
                    return capture(ids, position_ids=positions)

            states = forward().tapped_hidden.float()  # also compiles
            forward()
            ms = timed_ms(forward, repeats=args.repeats, device=torch.device("cuda" if cuda else "cpu"))
            if reference is None and variant == "bf16":
                reference = states
            error = float((states - reference).norm() / reference.norm()) if reference is not None else float("nan")
            row = {"variant": variant, "ms": ms, "tokens_per_s": ids.numel() / ms * 1e3, "tapped_rel_error": error,
                   "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan")}
        except Exception as error:  # noqa: BLE001 - report the variant that could not run, keep the others
            row = {"variant": variant, "failed": repr(error)[:300]}
        rows.append(row)
        del target
        torch._dynamo.reset()  # compiled code caches hold the variant's modules (and their weights) alive
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    device_name = torch.cuda.get_device_name() if cuda else "cpu"
    print(f"target forward, {args.docs} x {args.doc_len} tokens packed in one row, {device_name}")
    print(f"{'variant':<20}{'ms':>9}{'tokens/s':>12}{'peak GiB':>10}{'rel err vs bf16':>17}")
    for row in rows:
        if "failed" in row:
            print(f"{row['variant']:<20} failed: {row['failed']}")
        else:
            print(f"{row['variant']:<20}{row['ms']:>9.1f}{row['tokens_per_s']:>12,.0f}{row['peak_gib']:>10.1f}"
                  f"{row['tapped_rel_error']:>17.4f}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"device": device_name, "torch": torch.__version__, "rows": rows}, indent=2))
    print("reproduce: python3 bench/bench_target_fp8.py " + " ".join(sys.argv[1:] if argv is None else argv))
    return rows


if __name__ == "__main__":
    main()
