"""The acceptance bench's training data: the target's own greedy completions of the training prompts, generated
in chunks cached under --work (and taken from a folder of gzipped chunks where one is given), the held-out
baselines, and the in-memory corpus the Trainer reads."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import tarfile
import time
from pathlib import Path

import numpy as np
import torch

GENERATION_CHUNK = 4096

@torch.no_grad()
def greedy_completions(model, prompts: list[tuple[str, list[int]]], *, max_new_tokens: int, eos_id: int,
                       pad_id: int, batch_size: int, static_width: int | None = None) -> list[dict]:
    """Batched greedy `generate` (left padding; sorted by length, so little of it); each completion cut
    after its first EOS. The same tokens as one prompt at a time, up to near-ties that batched kernels
    round differently.

    `static_width`: every batch `batch_size` rows of that many prompt tokens (pad rows and left padding) on a
    static KV cache, so transformers compiles one decoding step for all of them and replays it as a CUDA graph
    on a GPU (its auto-compile; on a CPU it runs eager). Not measured on a GPU yet (`--generate-static`)."""
    device = next(model.parameters()).device
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i][1]))
    if static_width is not None and len(prompts[order[-1]][1]) > static_width:
        raise ValueError(f"a prompt of {len(prompts[order[-1]][1])} tokens is wider than static_width {static_width}")
    static = {} if static_width is None else {"cache_implementation": "static"}
    out: dict[int, list[int]] = {}
    for start in range(0, len(order), batch_size):
        chunk = order[start:start + batch_size]
        width = static_width or max(len(prompts[i][1]) for i in chunk)
        rows = batch_size if static_width is not None else len(chunk)  # pad rows keep the shape fixed
        ids = torch.full((rows, width), pad_id, dtype=torch.long)
        mask = torch.zeros((rows, width), dtype=torch.long)
        mask[len(chunk):, -1] = 1  # a pad row attends to one pad token; its output is dropped
        for row, i in enumerate(chunk):
            prompt = prompts[i][1]
            ids[row, width - len(prompt):] = torch.tensor(prompt)
            mask[row, width - len(prompt):] = 1
        generated = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), do_sample=False,
                                   max_new_tokens=max_new_tokens, eos_token_id=eos_id, pad_token_id=pad_id,
                                   **static)
        for row, i in enumerate(chunk):
            tokens = generated[row, width:].tolist()
            out[i] = tokens[: tokens.index(eos_id) + 1] if eos_id in tokens else tokens
    return [{"id": prompts[i][0], "prompt": prompts[i][1], "completion": out[i]} for i in range(len(prompts))]


def chunk_files(prompts: list[tuple[str, list[int]]], *, work: Path, max_new_tokens: int, tag: str,
                chunk: int = GENERATION_CHUNK) -> list[Path]:
    """Where `cached_completions` keeps each chunk of `prompts`: named by a hash of its prompts,
    `max_new_tokens` and `tag`."""
    paths = []
    for start in range(0, len(prompts), chunk):
        part = prompts[start:start + chunk]
        key = hashlib.sha256(json.dumps([part, max_new_tokens, tag]).encode()).hexdigest()[:20]
        paths.append(work / "completions" / f"chunk-{key}.json")
    return paths


def read_completions(index: Path) -> list[dict]:
    """The records `prepare_data`'s index file names: its chunk files' records, in order."""
    return [record for path in json.loads(index.read_text())["chunks"] for record in json.loads(Path(path).read_text())]


def cached_completions(model, prompts: list[tuple[str, list[int]]], *, work: Path, max_new_tokens: int, eos_id: int,
                       pad_id: int, batch_size: int, tag: str, chunk: int = GENERATION_CHUNK,
                       stop_at: float | None = None, carried: Path | None = None, export: Path | None = None,
                       static_width: int | None = None, log=print) -> list[dict]:
    """`greedy_completions` of `prompts`, `chunk` prompts at a time in their order, each chunk cached under
    `work/completions/` by a hash of its prompts, `max_new_tokens` and `tag`. Past `stop_at` (a time.time())
    it stops after the chunk in hand with a SystemExit that says how far it got: the same command with the same
    --work goes on from there. Growing the prompt list keeps every full chunk generated before.

    On another machine (a new --work): a chunk found gzipped in `carried` (the same name plus .gz) is taken from
    there instead of generated, and the chunks generated now are also written, each gzipped, into the tar archive
    `export` (<out>/completions.tar, one file however many chunks; unpack it into the `carried` folder,
    <assets>/completions/, for the next machine)."""
    folder = work / "completions"
    folder.mkdir(parents=True, exist_ok=True)
    chunks = [prompts[start:start + chunk] for start in range(0, len(prompts), chunk)]
    paths = chunk_files(prompts, work=work, max_new_tokens=max_new_tokens, tag=tag, chunk=chunk)
    records: list[dict] = []
    generated: dict[str, bytes] = {}  # this run's chunks, gzipped once each: <name>.gz -> bytes
    for index, (part, path) in enumerate(zip(chunks, paths)):
        packed = carried / f"{path.name}.gz" if carried is not None else None
        if not path.is_file() and packed is not None and packed.is_file():
            tmp = path.with_suffix(".tmp")
            tmp.write_bytes(gzip.decompress(packed.read_bytes()))
            tmp.replace(path)
            log(f"chunk {index + 1} of {len(chunks)} taken from {packed}")
        if not path.is_file():
            if stop_at is not None and time.time() > stop_at:
                raise SystemExit(f"generation stopped at its deadline: {index} of {len(chunks)} chunks of {chunk} "
                                 f"prompts are in {folder} ({len(generated)} of them generated in this run); run the "
                                 "same command again with the same --work to go on")
            began = time.perf_counter()
            part_records = greedy_completions(model, part, max_new_tokens=max_new_tokens, eos_id=eos_id,
                                              pad_id=pad_id, batch_size=batch_size, static_width=static_width)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(part_records))
            tmp.replace(path)  # a run killed mid-write leaves no half chunk behind
            generated[f"{path.name}.gz"] = gzip.compress(path.read_bytes(), mtime=0)
            if export is not None:
                write_chunk_archive(export, generated)
            log(f"generated chunk {index + 1} of {len(chunks)} ({len(part)} completions) in "
                f"{time.perf_counter() - began:.0f} s")
        records += json.loads(path.read_text())
    return records


def write_chunk_archive(archive: Path, chunks: dict[str, bytes]) -> None:
    """`archive`, a tar of the gzipped `chunks` (<name>.gz: what a carried folder holds), written whole each time:
    a run killed while writing it leaves the last complete one."""
    archive.parent.mkdir(parents=True, exist_ok=True)
    tmp = archive.with_suffix(".tmp")
    with tarfile.open(tmp, "w") as tar:
        for name, data in chunks.items():
            member = tarfile.TarInfo(name)
            member.size = len(data)
            tar.addfile(member, io.BytesIO(data))
    tmp.replace(archive)


def cached_baselines(model, prompts: list[tuple[str, list[int]]], *, work: Path, max_new_tokens: int, eos_id: int,
                     tag: str, log=print) -> list[dict]:
    """The target's own greedy output for each held-out prompt (what every drafter must reproduce), decoded
    once per --work: a later run with the same --work (--resume, the next point) reads it instead of decoding
    again. `tag` names what else fixes the tokens (dtype, model)."""
    from dflash_core.evaluate import greedy_decode

    key = hashlib.sha256(json.dumps([prompts, max_new_tokens, eos_id, tag]).encode()).hexdigest()
    path = work / f"baselines-{key[:16]}.json"
    if path.is_file():
        log(f"held-out baselines from {path.name} (decoded in an earlier run)")
        return json.loads(path.read_text())
    eval_set = []
    for prompt_id, prompt in prompts:
        decoded = greedy_decode(model, prompt, max_new_tokens=max_new_tokens, eos_token_id=eos_id)
        eval_set.append({"id": prompt_id, "prompt": list(prompt), "baseline": list(decoded.tokens),
                         "baseline_wall_s": decoded.wall_s})
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(eval_set))
    tmp.replace(path)  # a run killed mid-write decodes again next time
    return eval_set


def training_corpus(records: list[dict]):
    """In-memory TokenizedCorpus: prompt (loss 0) + completion (loss 1), exactly the ids generated."""
    from dflash_core.train.data import TokenizedCorpus

    tokens = [np.array(r["prompt"] + r["completion"], dtype=np.uint32) for r in records]
    masks = [np.array([0] * len(r["prompt"]) + [1] * len(r["completion"]), dtype=np.uint8) for r in records]
    offsets = np.concatenate(([0], np.cumsum([len(t) for t in tokens]))).astype(np.int64)
    return TokenizedCorpus(tokens=np.concatenate(tokens), loss_mask=np.concatenate(masks), offsets=offsets,
                           names=tuple(r["id"] for r in records))
