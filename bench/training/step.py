"""One online DFlash training step on the GPU alone: target forward + capture, drafter forward and backward,
AdamW, each timed, with peak memory and MFU against the bf16 matmul peak measured in the same process.

Default shape: a Qwen3-8B-shaped target (random weights), 4 x 2,048 tokens, B=16, 5 drafter layers, 128 anchors
per sequence (512 per 8,192 tokens). `--target qwen3.5-27b` checks that the 27B hybrid fits one GPU.
Prints a table and the command that reproduces it; loop.py times the whole training loop instead.

    python -m bench.training.step                      (one GPU)
    python -m bench.training.step --tiny               (CPU smoke)
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from dflash_core.model import DFlashConfig, plan_blocks
from dflash_core.model.build import build_drafter
from dflash_core.target import (
    HiddenStateCapture,
    build_target,
    build_target_on_device,
    real_shape_config,
    target_heads,
    tiny_target_config,
)
from dflash_core.target.runtime import compile_decoder_layers


def measure_matmul_peak(*, device, size: int = 8192, repeats: int = 20) -> float:
    """Median bf16 TFLOP/s of a size^3 matmul on random data (the MFU denominator)."""
    a = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    b = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        a @ b
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * size**3 / statistics.median(times) / 1e12


def measure_fp8_matmul_peak(*, device, size: int = 8192, repeats: int = 20) -> float:
    """Median e4m3 TFLOP/s of a size^3 torch._scaled_mm (row-wise scales, fast accumulation: the fastest
    FP8 GEMM the step uses), the FP8 GEMMs' MFU denominator."""
    a = torch.randn(size, size, device=device).to(torch.float8_e4m3fn)
    b = torch.randn(size, size, device=device).to(torch.float8_e4m3fn).t()
    scale_a = torch.ones(size, 1, device=device)
    scale_b = torch.ones(1, size, device=device)

    def gemm():
        return torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=torch.bfloat16,
                                use_fast_accum=True)

    for _ in range(3):
        gemm()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        gemm()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * size**3 / statistics.median(times) / 1e12


def step_flops(*, target_config, config: DFlashConfig, plans, batch: int, seq_len: int) -> float:
    """Useful FLOPs of one step (matmuls and visible attention pairs; backward = 2x forward, except
    fc and the LM head, whose input resp. weight need no gradient)."""
    return sum(step_flops_parts(target_config=target_config, config=config, plans=plans, batch=batch,
                                seq_len=seq_len).values())


def step_flops_parts(*, target_config, config: DFlashConfig, plans, batch: int, seq_len: int) -> dict[str, float]:
    """`step_flops` by the kind of work, so each part can be held against the peak of the precision it
    runs in: target_linears (the decoder layers' GEMMs), target_attention, teacher (the target's LM head
    at the needed positions), drafter_linears (block projections and MLPs, context K/V, fc: forward and
    backward), drafter_attention, lm_head (the drafter's loss against the vocabulary)."""
    t = target_config
    hidden, heads, kv_heads, head_dim = t.hidden_size, t.num_attention_heads, t.num_key_value_heads, config.head_dim
    per_layer = hidden * head_dim * (2 * heads + 2 * kv_heads) + 3 * hidden * t.intermediate_size
    tokens = batch * seq_len
    target = 2 * tokens * per_layer * t.num_hidden_layers
    target_attention = t.num_hidden_layers * 4 * batch * seq_len * (seq_len + 1) / 2 * heads * head_dim
    plan = plans[0]
    block = config.block_size
    anchors = plan.anchors[plan.anchor_valid].double()
    visible_pairs = float(((anchors + block) * block).sum())
    num_teacher = plan.teacher_index.numel() if plan.teacher_index is not None else plan.label_valid.numel()
    teacher = 2 * num_teacher * hidden * t.vocab_size
    layers = config.num_layers
    block_linear = 2 * batch * plan.num_anchors * block * per_layer * layers
    context_kv = 2 * tokens * 2 * hidden * kv_heads * head_dim * layers
    attention = layers * 4 * visible_pairs * heads * head_dim
    fc = 2 * tokens * config.num_tapped_layers * hidden * hidden
    lm_head = 2 * plan.label_valid.numel() * hidden * t.vocab_size
    return {"target_linears": target, "target_attention": target_attention, "teacher": teacher,
            "drafter_linears": 3 * (block_linear + context_kv) + 2 * fc, "drafter_attention": 3 * attention,
            "lm_head": 2 * lm_head}


def make_batches(*, num_batches, batch, seq_len, vocab, prompt_len, anchors_per_seq, block_size, seed):
    """Random token rows with a loss mask after a prompt, and block plans built on the CPU
    (as a data loader would, off the GPU's critical path)."""
    generator = torch.Generator().manual_seed(seed)
    batches, plan_seconds = [], []
    for _ in range(num_batches):
        input_ids = torch.randint(0, vocab, (batch, seq_len), generator=generator)
        loss_mask = torch.zeros(batch, seq_len, dtype=torch.bool)
        loss_mask[:, prompt_len:] = True
        started = time.perf_counter()
        plan = plan_blocks(
            loss_mask_BT=loss_mask, num_anchors=anchors_per_seq, block_size=block_size, generator=generator
        )
        plan_seconds.append(time.perf_counter() - started)
        batches.append((input_ids, plan))
    return batches, statistics.median(plan_seconds)


class _Clock:
    """Stage marks of one step: CUDA events on GPU (no sync inside the step), host time on CPU."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.marks = []
        self.mark()

    def mark(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def _ms(self, a, b) -> float:
        return a.elapsed_time(b) if self.cuda else (b - a) * 1e3

    def stage_ms(self) -> list[float]:
        return [self._ms(a, b) for a, b in zip(self.marks, self.marks[1:])]

    def since(self, later: "_Clock") -> float:
        """ms from this step's start to `later` step's start."""
        return self._ms(self.marks[0], later.marks[0])


def run_variant(args, *, name, teacher_mode, target, target_config, anchors_per_seq, device, peak_tflops):
    cuda = device.type == "cuda"
    if name not in ("eager", "compiled", "compiled_all"):
        raise ValueError(f"unknown variant {name!r}")
    compile_drafter = name.startswith("compiled")
    teacher = teacher_mode == "target"
    config = DFlashConfig.from_target(target_config, num_layers=args.drafter_layers, block_size=args.block_size)
    if cuda:
        with torch.device("meta"):
            drafter = build_drafter(config, device="meta")
        drafter.to_empty(device=device)
        drafter.init_weights()
    else:
        drafter = build_drafter(config)
    drafter.attach_target(target_heads(target))
    if compile_drafter:
        drafter.compile_layers()
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=1e-4, fused=cuda)
    capture = HiddenStateCapture(target, layer_ids=config.target_layer_ids, capture_final=teacher)
    batches, plan_seconds = make_batches(
        num_batches=args.warmup + args.steps, batch=args.batch, seq_len=args.seq_len, vocab=target_config.vocab_size,
        prompt_len=args.seq_len // 8, anchors_per_seq=anchors_per_seq, block_size=args.block_size, seed=0,
    )
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if cuda else torch.autocast("cpu", enabled=False)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()

    def one_step(input_ids_cpu, plan_cpu):
        input_ids = input_ids_cpu.to(device, non_blocking=True)
        plan = plan_cpu.to(device, non_blocking=True)
        clock = _Clock(cuda)
        captured = capture(input_ids)
        clock.mark()
        with autocast:
            _, loss, metrics = drafter(
                input_ids=input_ids, target_hidden=captured.tapped_hidden, plan=plan,
                teacher_hidden=captured.final_hidden,
            )
        loss.backward()
        clock.mark()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        clock.mark()
        return clock, metrics

    marks = []
    for step, (input_ids_cpu, plan_cpu) in enumerate(batches):
        clock, metrics = one_step(input_ids_cpu, plan_cpu)
        if step >= args.warmup:
            marks.append(clock)
    if args.profile:
        _profile(one_step, batches[:2], path=f"{args.profile}_{name}_{anchors_per_seq}.txt")
    if cuda:
        torch.cuda.synchronize()
    stage_ms = [clock.stage_ms() for clock in marks]
    # Step time from one step's start to the next one's: includes any host gap between steps.
    step_ms = [a.since(b) for a, b in zip(marks, marks[1:])] if cuda else [sum(row) for row in stage_ms]
    median_stage = [statistics.median(col) for col in zip(*stage_ms)]
    median_step = statistics.median(step_ms)
    flops = step_flops(
        target_config=target_config, config=config, plans=[batches[0][1]], batch=args.batch, seq_len=args.seq_len
    )
    capture.close()
    result = {
        "variant": name,
        "teacher": teacher_mode,
        "anchors_per_seq": anchors_per_seq,
        "tokens_per_s": args.batch * args.seq_len / (median_step / 1e3),
        "step_ms": median_step,
        "target_fwd_ms": median_stage[0],
        "drafter_fwd_bwd_ms": median_stage[1],
        "optimizer_ms": median_stage[2],
        "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan"),
        "tflop_per_step": flops / 1e12,
        "mfu": flops / (median_step / 1e3) / (peak_tflops * 1e12) if peak_tflops else float("nan"),
        "plan_cpu_ms": plan_seconds * 1e3,
        "final_loss": float(metrics["loss"]),
        "acceptance_length": float(metrics["acceptance_length"]),
    }
    del drafter, optimizer, metrics
    if cuda:
        torch.cuda.empty_cache()
    return result


def compile_target_layers(target, target_config, device) -> dict[str, list[float]]:
    """torch.compile each decoder layer's forward (static shapes; hooks stay eager, outside it).

    Returns per tapped layer (and the pre-norm final state) the relative error of the eager bf16
    and the compiled bf16 captures against an fp32 copy of the same weights, on one batch.
    """
    input_ids = torch.randint(0, target_config.vocab_size, (2, 512), device=device)
    layer_ids = DFlashConfig.from_target(target_config, num_layers=5).target_layer_ids

    def states(model):
        capture = HiddenStateCapture(model, layer_ids=layer_ids, capture_final=True)
        captured = capture(input_ids)
        capture.close()
        return [captured.layer(k).float() for k in layer_ids] + [captured.final_hidden.float()]

    reference_model = copy.deepcopy(target).float()
    reference = states(reference_model)
    del reference_model
    torch.cuda.empty_cache()
    eager = states(target)
    compile_decoder_layers(target)
    target._bench_compiled = True
    compiled = states(target)

    def errors(candidate):
        return [round(float((c - r).norm() / r.norm()), 4) for c, r in zip(candidate, reference)]

    return {"layers": layer_ids + ["final"], "eager_bf16_vs_fp32": errors(eager), "compiled_bf16_vs_fp32": errors(compiled)}


def _profile(one_step, batches, *, path: str) -> None:
    """Kernel-level breakdown of a couple of steps, for finding the next lever."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        for batch in batches:
            one_step(*batch)
        torch.cuda.synchronize() if torch.cuda.is_available() else None
    sort_by = "cuda_time_total" if torch.cuda.is_available() else "cpu_time_total"
    Path(path).write_text(prof.key_averages().table(sort_by=sort_by, row_limit=60, max_name_column_width=90))


def print_table(results, *, peak_tflops, command):
    header = (
        f"{'variant':<14}{'teacher':<8}{'A/seq':>6}{'tok/s':>9}{'step ms':>9}{'target':>8}{'drafter':>9}{'optim':>7}"
        f"{'peak GiB':>10}{'TFLOP':>7}{'MFU':>7}{'plan ms':>9}"
    )
    print(header)
    print("-" * len(header))
    for r in results:
        if "error" in r:
            print(f"{r['variant']:<14}{r['teacher']:<8}{r['anchors_per_seq']:>6}  FAILED: {r['error']}")
            continue
        print(
            f"{r['variant']:<14}{r['teacher']:<8}{r['anchors_per_seq']:>6}{r['tokens_per_s']:>9.0f}{r['step_ms']:>9.1f}"
            f"{r['target_fwd_ms']:>8.1f}{r['drafter_fwd_bwd_ms']:>9.1f}{r['optimizer_ms']:>7.1f}"
            f"{r['peak_mem_gib']:>10.1f}{r['tflop_per_step']:>7.1f}{r['mfu']:>7.1%}{r['plan_cpu_ms']:>9.1f}"
        )
    print(f"stages: target = target forward + capture; drafter = drafter fwd+bwd incl. teacher head and loss;"
          f" MFU against measured bf16 matmul peak {peak_tflops:.0f} TFLOP/s (median, 8192^3)")
    print(f"reproduce: {command}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="CPU smoke run on a tiny Qwen3-family target")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--anchors-per-seq", default="128", help="comma list, e.g. 128,512")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--drafter-layers", type=int, default=5)
    parser.add_argument(
        "--teacher", default="target",
        help="comma list: target (learn the target's argmax; full forward) and/or data (learn the data "
        "tokens; the target forward stops after the last tapped layer)",
    )
    parser.add_argument(
        "--variants", default="compiled_all",
        help="comma list, run in order: eager; compiled (drafter layers + loss kernel); compiled_all (also the "
        "target's decoder layers, compiled from then on)",
    )
    parser.add_argument("--target", default="qwen3-8b", choices=["qwen3-8b", "qwen3.5-27b"],
                        help="target shape (random weights); qwen3.5-27b is the fit check of a 27B hybrid")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--json", help="write results here")
    parser.add_argument("--profile", help="write a profiler table per variant to PREFIX_<variant>_<A>.txt")
    args = parser.parse_args(argv)
    if args.tiny:
        args.batch, args.seq_len, args.block_size, args.drafter_layers = 2, 128, 8, 2
        args.anchors_per_seq, args.warmup, args.steps = "8", 1, 2
        args.variants = "eager"
        torch.set_num_threads(1)  # tiny matmuls on a shared CPU: more threads only contend
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    if device.type == "cuda":
        target_config = real_shape_config(args.target)
        target = build_target_on_device(target_config, device=device, dtype=torch.bfloat16)
        print(json.dumps({"target": args.target, "params_b": sum(p.numel() for p in target.parameters()) / 1e9,
                          "weights_gib": torch.cuda.memory_allocated(device) / 2**30}), flush=True)
        peak = measure_matmul_peak(device=device)
    else:
        target_config = tiny_target_config("qwen3", num_layers=8)
        target = build_target(target_config)
        peak = 0.0
    torch._dynamo.config.cache_size_limit = 64  # 36 target layers share one graph; leave room
    results = []
    runs = [
        (name, teacher_mode, int(anchors))
        for name in args.variants.split(",")
        for teacher_mode in args.teacher.split(",")
        for anchors in args.anchors_per_seq.split(",")
    ]
    for name, teacher_mode, anchors_per_seq in runs:
        if name == "compiled_all" and not getattr(target, "_bench_compiled", False):
            print(json.dumps({"compiled_target_accuracy": compile_target_layers(target, target_config, device)}))
        try:
            results.append(run_variant(
                args, name=name, teacher_mode=teacher_mode, target=target, target_config=target_config,
                anchors_per_seq=anchors_per_seq, device=device, peak_tflops=peak,
            ))
        except Exception as error:  # keep the other variants' numbers when one fails to compile
            results.append({
                "variant": name, "teacher": teacher_mode, "anchors_per_seq": anchors_per_seq,
                "error": repr(error)[:300],
            })
        print(json.dumps(results[-1]), flush=True)
    command = "python -m bench.training.step " + " ".join(sys.argv[1:] if argv is None else argv)
    print_table(results, peak_tflops=peak, command=command.strip())
    if args.json:
        Path(args.json).write_text(json.dumps({"peak_tflops": peak, "results": results}, indent=2))


if __name__ == "__main__":
    main()
