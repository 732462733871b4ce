"""Checkpoints: drafter weights (safetensors, target weights never included), optimizer, LR
scheduler, sampler and RNG states, step. Written atomically (a temp dir renamed into place, meta
last; a full disk raises `DiskFull`, before the write or once its temp dir is removed), pruned to the
last N (renamed aside before deletion, so a crash mid-prune leaves no partial `step-*` dir), uploaded
to S3 by dflash_core.train.uploader, and found again for `--resume`.

    <root>/step-000100/model.safetensors   drafter weights
    <root>/step-000100/train_state.pt      optimizer, scheduler, sampler, RNG
    <root>/step-000100/meta.json           step, config, time; its presence marks the checkpoint complete
"""

from __future__ import annotations

import json
import os
import random
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from dflash_core.storage.disk import RUN_DISK_FULL_ADVICE as DISK_FULL_ADVICE
from dflash_core.storage.disk import discard_partial_write, require_free, tensor_bytes

MODEL_FILE = "model.safetensors"
STATE_FILE = "train_state.pt"
META_FILE = "meta.json"
_FILES = (MODEL_FILE, STATE_FILE, META_FILE)


def step_dir_name(step: int) -> str:
    return f"step-{step:06d}"


def capture_rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(root: Path, *, step: int, model_state: dict[str, torch.Tensor], train_state: dict[str, Any],
                    meta: dict[str, Any], keep_last: int) -> Path:
    """Write step `step` atomically and prune to the last `keep_last` complete checkpoints."""
    root.mkdir(parents=True, exist_ok=True)
    final = root / step_dir_name(step)
    tmp = root / f".{step_dir_name(step)}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    needed = tensor_bytes(model_state) + tensor_bytes(train_state)
    what = f"checkpoint {final.name}"
    require_free(root, needed, what=what, advice=DISK_FULL_ADVICE)
    tmp.mkdir()
    try:
        save_file({name: t.detach().contiguous().cpu() for name, t in model_state.items()}, tmp / MODEL_FILE)
        torch.save(train_state, tmp / STATE_FILE)
        (tmp / META_FILE).write_text(json.dumps({"step": step, "saved_at": time.time(), **meta}, indent=2,
                                                default=str))
        for name in _FILES:
            with open(tmp / name, "rb") as handle:
                os.fsync(handle.fileno())
    except Exception as error:  # a full disk raises DiskFull here; any other error, once the temp dir is gone
        discard_partial_write(error, partial=tmp, needed_bytes=needed, what=what, advice=DISK_FULL_ADVICE)
        raise
    if final.exists():
        shutil.rmtree(final)
    os.rename(tmp, final)
    prune(root, keep_last=keep_last)
    return final


def complete_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints under `root`, oldest first."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and p.name.startswith("step-")
             and all((p / name).is_file() for name in _FILES)]
    return sorted(found, key=lambda p: int(p.name.split("-")[1]))


def latest_checkpoint(root: Path) -> Path | None:
    complete = complete_checkpoints(root)
    return complete[-1] if complete else None


def prune(root: Path, *, keep_last: int) -> None:
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1, got {keep_last}")
    for old in complete_checkpoints(root)[:-keep_last]:
        _remove(old)
    for stale in root.glob(".step-*.tmp-*"):  # left by a crash mid-save
        if not stale.name.endswith(f"-{os.getpid()}"):
            shutil.rmtree(stale, ignore_errors=True)


def _remove(path: Path) -> None:
    """Rename aside, then delete: a crash mid-delete leaves a `.pruned-*` dir, never a partial `step-*`."""
    aside = path.with_name(f".pruned-{path.name}-{os.getpid()}")
    os.rename(path, aside)
    shutil.rmtree(aside)


def remove_debris(root: Path) -> list[str]:
    """Delete what crashes left under `root`: temp dirs of interrupted saves, dirs renamed aside by an
    interrupted prune, and `step-*` dirs missing files (partly deleted by an older prune). Call it only
    while holding the run's lock (dflash_core.train.run_lock): another live run's save is debris too."""
    if not root.is_dir():
        return []
    debris = [p for p in root.iterdir() if p.is_dir() and (
        p.name.startswith((".pruned-", ".step-"))
        or (p.name.startswith("step-") and not all((p / name).is_file() for name in _FILES)))]
    for path in debris:
        shutil.rmtree(path, ignore_errors=True)
    return sorted(p.name for p in debris)


def load_checkpoint(path: Path, *, device: str | torch.device = "cpu") -> tuple[dict[str, torch.Tensor], dict, dict]:
    model_state = load_file(path / MODEL_FILE, device=str(device))
    train_state = torch.load(path / STATE_FILE, map_location=device, weights_only=False)
    meta = json.loads((path / META_FILE).read_text())
    return model_state, train_state, meta
