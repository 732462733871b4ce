"""The acceptance bench: which recipe drafts best at an equal budget, on the embedded SmolLM2-135M target.

Trains a drafter under each recipe (`variants.py`: the library default, one change each, and speculators
0.9's own DFlash and DFlash 2, trained by its own forward and loss) on the same greedy self-completions of the
target, the same batches and budget, several seeds each, then evaluates every drafter with our evaluator on
held-out prompts (real draft/verify rounds, every output checked token for token against greedy decoding).
Prints the table (tau, tau - 1 and acc@1..4 as mean +- sd over seeds, tau - 1 as a ratio of speculators'
DFlash and DFlash 2 rows, steady training steps/s) and the command that reproduces each row.

    python -m bench.acceptance run --tiny                           (CPU smoke, ~3 min on 2 cores)
    python -m bench.acceptance run --suite core --steps 2000 --long-multiplier 0 --data-multipliers 4 \
        --eval-prompts 16 --eval-new-tokens 96 --workers 6 --train-compile           (one GPU)
    python -m bench.acceptance report A/results.jsonl B/results.jsonl --out DIR      (runs merged)
    python -m bench.acceptance curve RESULTS.jsonl [...] --out DIR                   (curve.py)
    python -m bench.acceptance prepare        (assets for a GPU machine without network, read with --assets)

--out gets table.md, results.jsonl (one line a job), summary.json; completions are cached in chunks of 4,096
under --work. `--checkpoint-every N` saves each job's training state and `--resume` (same command, same --work)
keeps the jobs that finished and continues the others. bench/README.md has the rest (several GPUs, MPS).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import sys
import time
from pathlib import Path

import torch

from dflash_core.train.config import COMPILE_MODES

from .data import prepare_assets, prepare_data
from .ours import check_recipe_applied, run_ours  # noqa: F401  (check_recipe_applied: tests)
from .report import host_text, row_command, run_header, write_report
from .scaling import plan_scaled_jobs
from .speculators import run_speculators
from .variants import (  # noqa: F401  (Shape, Variant: tests)
    DEFAULT_VARIANTS, FULL, LONG_VARIANTS, SUITES, TINY, Job, Shape, Variant, variants,
)
from .worker import WORKER, worker_init


def run_job(job: Job) -> dict | None:
    """Train and evaluate one job in this worker; None when the run's deadline passed before it began."""
    if WORKER.get("deadline_at") is not None and time.time() > WORKER["deadline_at"]:
        return None
    variant = variants()[job.variant]
    began = time.perf_counter()
    out = (run_ours if variant.kind == "ours" else run_speculators)(job, variant)
    multiplier = getattr(job, "data_multiplier", None)
    data = {} if multiplier is None else {"data_multiplier": multiplier,
                                          "train_completions": multiplier * WORKER["shape"]["train_prompts"]}
    return {"variant": job.variant, "seed": job.seed, "steps": job.steps,
            "token_budget": WORKER["shape"]["token_budget"], **data,
            "wall_s": time.perf_counter() - began, "device": WORKER["device"], **out}


# ---- arguments ----------------------------------------------------------------------------------

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.acceptance", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("action", nargs="?", choices=["run", "prepare", "report"], default="run")
    parser.add_argument("results", nargs="*", type=Path, help="report: results.jsonl files of earlier runs")
    parser.add_argument("--tiny", action="store_true", help="CPU smoke: the tiny suite, 1 seed, 4 steps")
    parser.add_argument("--out", type=Path, default=Path(".dflash/bench_acceptance"))
    parser.add_argument("--work", type=Path, default=None, help="runs, data and model cache (default <out>/work)")
    parser.add_argument("--models-dir", type=Path, default=Path(".dflash/models"),
                        help="converted target cache (shared with the trainer's default)")
    parser.add_argument("--assets", type=Path, default=None, help="the folder `prepare` wrote (default .carry/acceptance): the target, "
                        "prompts and completions for a machine without network")
    parser.add_argument("--suite", choices=sorted(SUITES), default=None,
                        help="a named set of rows (variants.SUITES)")
    parser.add_argument("--variants", default=None, help="comma-separated, after the suite's; default all "
                        "(tiny: the tiny suite)")
    parser.add_argument("--long-variants", default=",".join(LONG_VARIANTS))
    parser.add_argument("--seeds", type=int, nargs="+", default=None, help="default 0 1 2 (tiny: 0)")
    parser.add_argument("--long-seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--long-multiplier", type=int, default=None, help="0: no long runs")
    parser.add_argument("--train-prompts", type=int, default=None)
    parser.add_argument("--data-multipliers", type=int, nargs="+", default=None,
                        help="data-scaling curve: every row and seed at each multiple of --train-prompts "
                        "(nested subsets of the completions), e.g. 1 2 4 8")
    parser.add_argument("--token-budget", type=int, default=None,
                        help="tokens per packed row (default 2,048); a larger row trains more tokens a second "
                        "where the host's share of a step, which does not grow with the row, holds the GPU back")
    parser.add_argument("--anchors", type=int, default=None,
                        help="anchors per row (default: 128 per 2,048 tokens, the density kept at any --token-budget)")
    parser.add_argument("--eval-new-tokens", type=int, default=None)
    parser.add_argument("--train-new-tokens", type=int, default=None, help="longest training completion")
    parser.add_argument("--eval-prompts", type=int, default=None, help="held-out ShareGPT prompts (+ 6 of our own)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="where the data and baselines are made (and the workers, without --devices)")
    parser.add_argument("--devices", default=None, help="comma-separated devices the workers spread over, e.g. "
                        "cuda:0,cuda:1 (default: --device)")
    parser.add_argument("--workers", type=int, default=None, help="processes (default: 8 per CUDA device, 1 on CPU)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads per worker (default: cores / workers; 1 on CPU, where a busy machine "
                        "turns spinning intra-op threads into a 10x slowdown)")
    parser.add_argument("--attention", choices=["sdpa", "flex", "auto"], default="auto",
                        help="our rows' drafter attention in training (TrainConfig.attention_backend; auto: flex on a "
                        "GPU, as a run trains; speculators' rows likewise). sdpa computes the whole [queries x "
                        "keys] grid where the mask lets 1-2%% through; rows before 2026-12-05 trained so")
    parser.add_argument("--eval-dtype", choices=["float32", "bfloat16"], default="float32",
                        help="target and drafter dtype while evaluating (fp32: exact greedy agreement)")
    parser.add_argument("--deadline-s", type=float, default=None,
                        help="no job starts after this many seconds (a started one finishes); the table has what "
                        "finished. Leave a job's length inside the time you have.")
    parser.add_argument("--train-compile", nargs="?", const="default", default=None,
                        choices=COMPILE_MODES,
                        help="our rows train with TrainConfig.compile, in this torch.compile mode (TrainConfig."
                        "compile_mode; default: default): drafter and target layers compiled; reduce-overhead "
                        "replays them as CUDA graphs (slower: docs/benchmarks.md). Speculators' rows compile their "
                        "forward anyway")
    parser.add_argument("--checkpoint-every", type=int, default=None,
                        help="each job saves its training state every N steps (in --work), so a job stopped midway "
                        "goes on with --resume; default: none")
    parser.add_argument("--save-drafters", type=Path, default=None,
                        help="each row's trained drafter saved under DIR/<job>: ours exported (native and speculators "
                        "formats), speculators' with its own save_pretrained; what bench.decoding.served serves")
    parser.add_argument("--resume", action="store_true",
                        help="after a run that was stopped, with the same --work: jobs that finished then are "
                        "not run again (their rows come from --work), the others go on from their last state")
    parser.add_argument("--eval-harness", choices=["auto", "eager", "graphs"], default="auto",
                        help="how each drafter is evaluated: auto takes CUDA graphs on a GPU (the evaluate stage's "
                        "default; the same tokens as eager, faster); eager, the harness of the rows before 2026-12-04")
    parser.add_argument("--generate-static", action="store_true",
                        help="generate the training completions in fixed-shape batches on a static KV cache, which "
                        "transformers compiles and replays as CUDA graphs on a GPU (the same tokens; slower than eager "
                        "on an H200 with its compilation: docs/benchmarks.md)")
    parser.add_argument("--generate-batch", type=int, default=None,
                        help="completions decoded at once (default 1,024 on a GPU, 16 on the CPU). The eager step at "
                        "1,024 is mostly host time, so a larger batch may generate a chunk faster; fp32 KV of "
                        "SmolLM2 is ~46 KB a token, ~24 GB a 1,024 batch at 512 tokens. A chunk's "
                        "cache key leaves the batch out: batched decoding may differ by a token here and there, and "
                        "chunks made at two batch sizes mix")
    parser.add_argument("--generate-deadline-s", type=float, default=None,
                        help="stop generating training completions after this many seconds (after the chunk in hand; "
                        "chunks are cached under --work), so a run that cannot generate them all ends in time and "
                        "the same command with the same --work goes on")
    parser.add_argument("--speculators-eager", action="store_true", help="do not torch.compile speculators' forward")
    args = parser.parse_args(argv)
    if args.generate_batch is not None and args.generate_batch < 1:
        parser.error(f"--generate-batch must be at least 1, got {args.generate_batch}")
    return args


def resolve_shape(args: argparse.Namespace) -> Shape:
    """The tiny or full shape with the flags given; a --token-budget without --anchors keeps the anchor density
    (the full shape's 128 per 2,048 tokens: 512 on an 8,192-token row)."""
    shape = TINY if args.tiny else FULL
    anchors = args.anchors
    if anchors is None and args.token_budget is not None:
        anchors = max(1, shape.num_anchors * args.token_budget // shape.token_budget)
    return dataclasses.replace(shape, **{k: v for k, v in {
        "steps": args.steps, "long_multiplier": args.long_multiplier, "train_prompts": args.train_prompts,
        "eval_prompts": args.eval_prompts, "token_budget": args.token_budget, "num_anchors": anchors,
        "eval_new_tokens": args.eval_new_tokens, "train_new_tokens": args.train_new_tokens}.items() if v is not None})


def resolve_rows(args: argparse.Namespace) -> list[str]:
    """The suite's rows, then --variants' (each once); without either, all (tiny: the tiny suite)."""
    names = list(SUITES[args.suite]) if args.suite else []
    names += [n for n in (args.variants.split(",") if args.variants else []) if n not in names]
    if not names:
        names = list(SUITES["tiny"] if args.tiny else DEFAULT_VARIANTS)
    unknown = sorted(set(names) - set(variants()))
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; known: {sorted(variants())}")
    return names


def plan_jobs(args: argparse.Namespace, shape: Shape, names: list[str]) -> list[Job]:
    """Long jobs first (they set the run's length), then seed-major: if the deadline cuts the run
    short, every row still has its first seeds."""
    seeds = args.seeds or ([0] if args.tiny else [0, 1, 2])
    if args.data_multipliers:
        long_jobs = [(name, seed, shape.steps * shape.long_multiplier) for name in args.long_variants.split(",")
                     for seed in args.long_seeds] if shape.long_multiplier else []
        return plan_scaled_jobs(names, seeds, shape.steps, args.data_multipliers, long_jobs=long_jobs)
    jobs = [Job(name, seed, shape.steps) for seed in seeds for name in names]
    if shape.long_multiplier:
        jobs = [Job(name, seed, shape.steps * shape.long_multiplier) for name in args.long_variants.split(",")
                for seed in args.long_seeds] + jobs
    return jobs


# ---- running the jobs ---------------------------------------------------------------------------

def run_jobs(jobs: list[Job], context: dict, *, workers: int, record, log) -> None:
    """Every job in `workers` processes (spawned; each takes the next device in turn), or in this one."""
    if workers == 1:
        worker_init(context)
        for job in jobs:
            result = run_job(job)
            if result is None:
                log(f"deadline: {job.label} and the jobs after it not started")
                break
            record(result)
        return
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, as_completed

    spawn = multiprocessing.get_context("spawn")
    counter = spawn.Value("i", 0)
    with ProcessPoolExecutor(workers, mp_context=spawn, initializer=worker_init,
                             initargs=(context, counter)) as executor:
        futures = {executor.submit(run_job, job): job for job in jobs}
        for future in as_completed(futures):
            try:
                result = future.result()
            except Exception as error:  # one failed job must not lose the others' rows
                log(f"FAILED {futures[future].label}: {type(error).__name__}: {error}")
                continue
            if result is None:
                log(f"deadline: {futures[future].label} not started")
            else:
                record(result)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.action == "prepare":
        prepare_assets(args.assets or Path(".carry/acceptance"))
        return
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    if args.action == "report":
        results = [json.loads(line) for path in args.results for line in path.read_text().splitlines() if line]
        text = write_report(out, results, header=f"merged from {', '.join(map(str, args.results))}",
                            variant_order=list(variants()))
        print(text)
        return

    devices = args.devices.split(",") if args.devices else [args.device]
    cuda = devices[0].startswith("cuda")
    workers = args.workers or (8 * len(devices) if cuda else 1)
    if args.threads is None:
        args.threads = max(1, (os.cpu_count() or 2) // workers) if cuda else 1
    torch.set_num_threads(args.threads)
    shape = resolve_shape(args)
    names = resolve_rows(args)
    jobs = plan_jobs(args, shape, names)
    work = args.work or out / "work"
    work.mkdir(parents=True, exist_ok=True)
    began, began_epoch = time.perf_counter(), time.time()  # workers are other processes: they read the epoch

    def log(message: str) -> None:
        print(f"[{time.perf_counter() - began:6.1f}s] {message}", flush=True)

    context = prepare_data(args, shape, work, log)
    if args.data_multipliers:  # the pool may allow fewer sizes than asked
        jobs = plan_jobs(args, shape, names)
    context.update(devices=devices, threads=args.threads, checkpoint_every=args.checkpoint_every, resume=args.resume,
                   save_drafters=str(args.save_drafters) if args.save_drafters else None,
                   train_compile=args.train_compile,
                   deadline_at=None if args.deadline_s is None else began_epoch + args.deadline_s)
    results_path = out / "results.jsonl"
    results_path.write_text("")
    results: list[dict] = []
    done_dir = work / "done"
    done_dir.mkdir(exist_ok=True)
    finished = {job: done_dir / f"{done_key(job, context)}.json" for job in jobs}
    earlier = [job for job in jobs if args.resume and finished[job].is_file()]
    jobs = [job for job in jobs if job not in earlier]
    log(f"held-out baselines ready; {len(jobs)} jobs on {workers} workers over {devices}"
        + (f"; {len(earlier)} finished in an earlier run" if earlier else ""))

    def report() -> str:
        header = run_header(shape=shape, args=args, num_records=context["num_records"],
                            num_eval=len(context["eval_set"]), elapsed_s=time.perf_counter() - began)
        return write_report(out, results, header=header, variant_order=list(variants()),
                            extra={"shape": dataclasses.asdict(shape)})

    command = row_command(sys.argv[1:] if argv is None else argv)

    def record(result: dict, *, earlier: bool = False) -> None:
        if not earlier:
            result["command"] = command  # the row's reproduce command, also once merged with other runs
            job = next(j for j in finished if (j.variant, j.seed, j.steps, getattr(j, "data_multiplier", None))
                       == (result["variant"], result["seed"], result["steps"], result.get("data_multiplier")))
            finished[job].write_text(json.dumps(result))  # a --resume run takes this row instead of rerunning
        results.append(result)
        with open(results_path, "a") as handle:
            handle.write(json.dumps(result) + "\n")
        size = f" {result['data_multiplier']}x data" if "data_multiplier" in result else ""
        log(f"{result['variant']} seed {result['seed']} {result['steps']} steps{size}: tau {result['tau']:.3f} "
            f"(acc@1 {result['acceptance_per_position'][0]:.2f}), {result['steps_per_s']:.1f} steps/s, "
            f"exact {result['all_match_target']}; {result['wall_s']:.0f} s (train {result['train_s']:.0f}, "
            f"eval {result['eval_s']:.0f}) on {result['device']}{host_text(result)}")
        report()

    for job in earlier:
        record(json.loads(finished[job].read_text()), earlier=True)
    run_jobs(jobs, context, workers=workers, record=record, log=log)
    print("\n" + report())
    print("\nreproduce: python -m bench.acceptance " + " ".join(sys.argv[1:] if argv is None else argv))


def done_key(job: Job, context: dict) -> str:
    """A finished job's name in --work: its label and what its row depends on beyond it (shape, data,
    held-out prompts, harness), so a --resume run with other settings reruns it."""
    what = [job.label, context["shape"], Path(context["data_path"]).name, [item["id"] for item in context["eval_set"]],
            context["eval_harness"], context["eval_dtype"]]
    return f"{job.run_name}-{hashlib.sha256(json.dumps(what).encode()).hexdigest()[:12]}"


if __name__ == "__main__":
    main()
