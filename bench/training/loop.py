"""The real training loop end to end (dflash_core.train.loop.Trainer): packing on the prefetch thread, anchor
plans, the target forward over packed rows (flex attention, documents from position ids), the drafter step,
AdamW and metrics, on synthetic tokenized data and a random-weight target of a real shape (default Qwen3-8B, one
8,192-token row of 4 documents, 512 anchors, B=16, 5 layers). This times what a run does, host work included;
step.py times the GPU step alone.

ms/step is the median of the per-step times on the GPU's timeline (CUDA events recorded after each step's work is
queued, so a GPU left idle by the host counts); metrics are synced every --log-every steps, as in a run. The host
columns say whether the host is on the critical path (prep: getting the batch; dispatch: queuing the step; wait:
blocked on the GPU). MFU is against the bf16 matmul peak measured in the same process; "at precision" holds each
part of the useful FLOPs against the peak of the precision it runs in (the FP8 options' GEMMs).

    python -m bench.training.loop [--variant dflash|dflash2] [--target-fp8] [--drafter-fp8 tensorwise|rowwise]
        [--lm-head-fp8] [--attention flex|sdpa] [--compile-mode MODE] [--json ROW.json]        (one GPU)
    python -m bench.training.loop --target random:smollm2-135m --token-budget 8192 --sample-len 256 \
        --anchors 512 --layers 2 --block-size 8      (the acceptance bench's step, alone on the GPU)
    python -m bench.training.loop --tiny [--variant dflash2] [--profile]                       (CPU smoke)

--profile: after the timed steps, --profile-steps steps under torch.profiler; prints the top ops by device
time, the GPU's busy share of the wall, each Trainer phase's span and kernel time, the top kernels and the
host's top ops (profile.py), and writes the chrome trace to --profile-out with the tables beside it.
--sync-debug counts synchronizing CUDA calls during the timed steps.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import torch

from dflash_core.target import real_shape_config
from dflash_core.train.assemble import build_trainer
from dflash_core.train.config import COMPILE_MODES, TrainConfig
from dflash_core.train.data import TokenizedCorpus
from dflash_core.train.strategies import StepTiming

from .profile import StepProfiler, default_profile_out, format_trace_summary
from .step import measure_fp8_matmul_peak, measure_matmul_peak

def useful_tflop_parts(trainer, args) -> dict[str, float]:
    """step.py's useful-FLOP count of one step by kind of work (TFLOP), for a plan like the
    trainer's: each packed sample a document with its first eighth prompt, the row's anchors shared out evenly."""
    from .step import step_flops_parts
    from dflash_core.model.anchors import plan_blocks

    samples = args.token_budget // args.sample_len
    loss_mask = torch.ones(samples, args.sample_len, dtype=torch.bool)
    loss_mask[:, : args.sample_len // 8] = False
    plan = plan_blocks(loss_mask_BT=loss_mask, num_anchors=args.anchors // samples, block_size=args.block_size,
                       generator=torch.Generator().manual_seed(0))
    target_config = getattr(trainer.target.config, "text_config", trainer.target.config)
    parts = step_flops_parts(target_config=target_config, config=trainer.drafter_config, plans=[plan],
                             batch=samples, seq_len=args.sample_len)
    return {name: flops / 1e12 for name, flops in parts.items()}


def precision_floor_ms(parts: dict[str, float], *, target_fp8: bool, drafter_fp8: bool, bf16_peak: float,
                       fp8_peak: float, lm_head_fp8: bool = False) -> float:
    """ms one step's useful FLOPs take with each part at the measured peak of the precision it runs in:
    the target's linears, the drafter's own linears and the LM-head GEMMs (the loss's and the teacher's) in FP8
    where those options are on; attention in bf16. MFU against it = this / the measured step."""
    fp8_parts = {"target_linears"} if target_fp8 else set()
    fp8_parts |= {"drafter_linears"} if drafter_fp8 else set()
    fp8_parts |= {"lm_head", "teacher"} if lm_head_fp8 else set()
    return 1e3 * sum(tflop / (fp8_peak if name in fp8_parts else bf16_peak) for name, tflop in parts.items())


def synthetic_corpus(*, num_samples: int, length: int, vocab: int, seed: int = 0) -> TokenizedCorpus:
    """Samples of `length` random tokens; the first eighth is prompt (no loss). The last embedding row
    never occurs, so the trainer can always pick it as the mask token."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(1, vocab - 1, size=num_samples * length, dtype=np.uint32)
    mask = np.tile(np.r_[np.zeros(length // 8, np.uint8), np.ones(length - length // 8, np.uint8)], num_samples)
    offsets = np.arange(num_samples + 1, dtype=np.int64) * length
    return TokenizedCorpus(tokens=tokens, loss_mask=mask, offsets=offsets, names=("synthetic",))


class StepClock:
    """A mark after each step's work is queued: a CUDA event on the GPU (read after the run, so no
    sync in the loop), host time on the CPU."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.marks: dict[int, object] = {}

    def mark(self, step: int) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks[step] = event
        else:
            self.marks[step] = time.perf_counter()

    def step_ms(self, first: int, last: int) -> list[float]:
        """ms of steps first+1..last, each from the previous step's mark to its own."""
        if self.cuda:
            torch.cuda.synchronize()
            return [self.marks[s - 1].elapsed_time(self.marks[s]) for s in range(first + 1, last + 1)]
        return [1e3 * (self.marks[s] - self.marks[s - 1]) for s in range(first + 1, last + 1)]


def main(argv: list[str] | None = None) -> dict:
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
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--log-every", type=int, default=10, help="metrics synced every N steps (a run's default)")
    parser.add_argument("--prefetch", type=int, default=2, help="batches packed ahead on a thread (0: inline)")
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--compile-mode", choices=COMPILE_MODES,
                        default="default", help="torch.compile's mode (TrainConfig.compile_mode; reduce-overhead: "
                        "each compiled layer replayed as a CUDA graph)")
    parser.add_argument("--variant", choices=["dflash", "dflash2"], default="dflash",
                        help="drafter variant (drafter.variant in the run config)")
    parser.add_argument("--profile", action="store_true", help="profile steps after the timed ones (see above)")
    parser.add_argument("--profile-steps", type=int, default=3)
    parser.add_argument("--profile-out", type=Path, help="chrome trace path (.json or .json.gz)")
    parser.add_argument("--target-fp8", action="store_true",
                        help="the target's decoder-layer GEMMs in FP8 (TrainConfig.target_fp8)")
    parser.add_argument("--exact-fp8-accum", dest="fp8_fast_accum", action="store_false",
                        help="with --target-fp8: FP8 GEMMs without use_fast_accum (TrainConfig.target_fp8_fast_accum)")
    parser.add_argument("--drafter-fp8", nargs="?", const="tensorwise", choices=["rowwise", "tensorwise"],
                        help="the drafter's own linears in FP8 through torchao's float8 training, with this "
                             "scaling recipe (default tensorwise; TrainConfig.drafter_fp8, drafter_fp8_recipe)")
    parser.add_argument("--lm-head-fp8", action="store_true",
                        help="the drafter loss's two LM-head GEMMs in FP8 (TrainConfig.lm_head_fp8)")
    parser.add_argument("--attention", choices=["auto", "flex", "sdpa"], default="auto",
                        help="the drafter's training attention (TrainConfig.attention_backend; auto: flex on a GPU); "
                        "sdpa, the dense path, is how the acceptance bench trained before 2026-12-05")
    parser.add_argument("--sync-debug", action="store_true", help="count synchronizing CUDA calls in the timed steps")
    parser.add_argument("--json", type=Path, help="write the result row here")
    args = parser.parse_args(argv)
    if args.tiny:
        args.target, args.token_budget, args.sample_len, args.anchors = "tiny:qwen3", 256, 64, 16
        args.layers, args.block_size, args.warmup, args.steps = 1, 8, 1, 3
        args.log_every, args.profile_steps = min(args.log_every, 2), min(args.profile_steps, 2)
    cuda = torch.cuda.is_available() and not args.tiny
    vocab = real_shape_config(args.target.split(":", 1)[1]).vocab_size if args.target.startswith("random:") else 256
    extra = 1 + args.profile_steps if args.profile else 0
    max_steps = args.warmup + args.steps + extra
    corpus = synthetic_corpus(num_samples=(max_steps + 2) * args.token_budget // args.sample_len,
                              length=args.sample_len, vocab=vocab)
    output_dir = Path(tempfile.mkdtemp(prefix="bench-e2e-"))
    config = TrainConfig(
        run_name="bench-e2e", target=args.target, data=["synthetic"], output_dir=output_dir,
        token_budget=args.token_budget, max_steps=max_steps, log_every=args.log_every, upload_checkpoints=False,
        checkpoint_every=max_steps + 1, compile=cuda and not args.no_compile, compile_mode=args.compile_mode,
        validate_capture_batches=1,
        drafter={"num_layers": args.layers, "block_size": args.block_size, "num_anchors": args.anchors,
                 "loss_target": args.teacher, "variant": args.variant}, prefetch_batches=args.prefetch,
        target_fp8=args.target_fp8, target_fp8_fast_accum=args.fp8_fast_accum,
        drafter_fp8=args.drafter_fp8 is not None, drafter_fp8_recipe=args.drafter_fp8 or "tensorwise",
        lm_head_fp8=args.lm_head_fp8, attention_backend=args.attention,
    )
    started = time.perf_counter()
    trainer = build_trainer(config, corpus=corpus)
    trainer.save = lambda: None  # time training, not checkpoint writes
    setup_s = time.perf_counter() - started
    trainer.validate_capture()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    timed_first, timed_last = args.warmup, args.warmup + args.steps  # steps timed_first+1 .. timed_last
    clock = StepClock(cuda)
    timings = {}
    records: list[dict] = []
    profile_out = args.profile_out or default_profile_out(output_dir)
    profiler = StepProfiler(start_after=timed_last, steps=args.profile_steps, cuda=cuda, out=profile_out) \
        if args.profile else None
    window_wall = {}

    def on_step(*, step: int, metrics, timing) -> None:
        clock.mark(step)
        timings[step] = timing
        if step in (timed_first, timed_last):
            if args.sync_debug and cuda and step == timed_last:
                torch.cuda.set_sync_debug_mode(0)  # before the bench's own sync
            if cuda:
                torch.cuda.synchronize()
            window_wall[step] = time.perf_counter()
            if args.sync_debug and cuda and step == timed_first:
                torch.cuda.set_sync_debug_mode("warn")
        if profiler is not None:
            profiler.on_step(step)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            trainer.run(on_log=records.append, on_step=on_step)
        finally:
            if profiler is not None:
                profiler.stop()
            if cuda:
                torch.cuda.set_sync_debug_mode(0)
    syncs = sum("synchroniz" in str(w.message) for w in caught)
    for w in caught:
        if "synchroniz" not in str(w.message):
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    step_ms = clock.step_ms(timed_first, timed_last)
    median_ms = statistics.median(step_ms)
    wall_ms = 1e3 * (window_wall[timed_last] - window_wall[timed_first]) / args.steps
    timed = [timings[s] for s in range(timed_first + 1, timed_last + 1)]
    host = StepTiming.mean_ms(timed)
    real_tokens = args.token_budget  # every row is full: samples tile the budget exactly
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan")
    last = records[-1]
    selector_tau = last.get("selector_acceptance_length", float("nan"))  # DFlash 2 only
    tflop_parts = useful_tflop_parts(trainer, args)
    tflop = sum(tflop_parts.values())
    peak_tflops = measure_matmul_peak(device="cuda") if cuda else float("nan")
    fp8_peak_tflops = measure_fp8_matmul_peak(device="cuda") if cuda else float("nan")
    mfu = tflop / (median_ms / 1e3) / peak_tflops
    floor_ms = precision_floor_ms(tflop_parts, target_fp8=args.target_fp8, drafter_fp8=args.drafter_fp8 is not None,
                                  bf16_peak=peak_tflops, fp8_peak=fp8_peak_tflops, lm_head_fp8=args.lm_head_fp8)
    precisions = {"target_gemms": "fp8 rowwise" if args.target_fp8 else "bf16",
                  "drafter_gemms": f"fp8 {args.drafter_fp8}" if args.drafter_fp8 else "bf16",
                  "lm_head_gemms": "fp8 rowwise" if args.lm_head_fp8 else "bf16"}
    row = {
        "target": args.target, "variant": args.variant, "tokens_per_row": args.token_budget, "anchors": args.anchors,
        "ms_per_step": median_ms, "wall_ms_per_step": wall_ms, "tokens_per_s": real_tokens / median_ms * 1e3,
        "peak_gib": peak, "host_prepare_ms": host["prepare"], "host_dispatch_ms": host["dispatch"],
        "host_wait_ms": host["wait"], "loss": last["loss"], "acceptance_length": last["acceptance_length"],
        "selector_acceptance_length": selector_tau, "setup_s": setup_s, "per_step_ms": step_ms,
        "useful_tflop": tflop, "matmul_peak_tflops": peak_tflops, "mfu": mfu,
        "useful_tflop_parts": tflop_parts, "fp8_matmul_peak_tflops": fp8_peak_tflops, "precisions": precisions,
        "precision_floor_ms": floor_ms, "mfu_at_precision": floor_ms / median_ms,
        "sync_debug_warnings": syncs if args.sync_debug and cuda else None,
        "drafter_parameters": sum(p.numel() for p in trainer.drafter.parameters()),
        "settings": {key: str(value) if isinstance(value, Path) else value for key, value in vars(args).items()},
        "compile": config.compile, "compile_mode": config.compile_mode, "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if cuda else "cpu",
    }
    print(f"{'target':<18}{'variant':<9}{'tokens/row':>11}{'anchors':>8}{'ms/step':>9}{'tokens/s':>10}"
          f"{'peak GiB':>9}{'prep ms':>8}{'disp ms':>8}{'wait ms':>8}{'loss':>8}{'tau':>7}{'sel tau':>8}{'setup s':>8}")
    print(f"{args.target:<18}{args.variant:<9}{args.token_budget:>11}{args.anchors:>8}{median_ms:>9.1f}"
          f"{row['tokens_per_s']:>10,.0f}{peak:>9.1f}{host['prepare']:>8.2f}{host['dispatch']:>8.1f}{host['wait']:>8.1f}"
          f"{last['loss']:>8.3f}{last['acceptance_length']:>7.3f}{selector_tau:>8.3f}{setup_s:>8.1f}")
    print(f"drafter parameters: {row['drafter_parameters']:,}; prefetch {args.prefetch}, metrics synced every "
          f"{args.log_every} steps; wall {wall_ms:.1f} ms/step over the timed window; useful {tflop:.1f} TFLOP/step, "
          f"MFU {mfu:.1%} of the measured bf16 matmul peak {peak_tflops:.0f} TFLOP/s (FLOP limit "
          f"{tflop / peak_tflops * 1e3:.0f} ms)")
    print(f"GEMM precisions: target {precisions['target_gemms']}, drafter {precisions['drafter_gemms']}, loss LM head "
          f"{precisions['lm_head_gemms']}; measured "
          f"FP8 peak {fp8_peak_tflops:.0f} TFLOP/s; each part at the peak of its precision: {floor_ms:.0f} ms, MFU "
          f"against it {floor_ms / median_ms:.1%}")
    print(f"per-step ms after warmup: {[round(x) for x in step_ms]}")
    if args.sync_debug and cuda:
        print(f"synchronizing CUDA calls in {args.steps} timed steps: {syncs}")
    if profiler is not None and profiler.summary is not None:
        print(profiler.table)
        print(format_trace_summary(profiler.summary))
        print(f"chrome trace: {profile_out}")
        row["profile"] = {**profiler.summary, "trace": str(profile_out)}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(row, indent=2))
    print("reproduce: python -m bench.training.loop " + " ".join(sys.argv[1:] if argv is None else argv))
    trainer.close()
    return row


if __name__ == "__main__":
    main()
