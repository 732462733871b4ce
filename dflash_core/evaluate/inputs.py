"""What an evaluation reads, parsed from bytes and local files (fetching stays in tasks/evaluate.py).

Prompts come from a tokenized Arrow shard (the prompt is every token before the first loss token,
i.e. the conversation up to where the assistant's reply starts) or from JSONL, one object a line
with `input_ids` (token ids) or `text` (tokenized with the target's tokenizer). The drafter comes
from a training checkpoint dir: model.safetensors plus meta.json with `drafter_config`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from dflash_core.layout import CHECKPOINT_META_FILE, CHECKPOINT_MODEL_FILE
from dflash_core.model.build import build_drafter
from dflash_core.model.dflash2 import config_from_dict
from dflash_core.model.loss_spec import LossSpec



def _clip(ids: list[int], max_prompt_tokens: int) -> list[int]:
    return ids[-max_prompt_tokens:]


def prompts_from_tokenized(data: bytes, *, num_prompts: int, max_prompt_tokens: int) -> list[list[int]]:
    """Prompts of a tokenized Arrow shard: input_ids before the first loss token (rows without one skipped)."""
    from dflash_core.tokenize.io import read_arrow_bytes

    table = read_arrow_bytes(data)
    missing = {"input_ids", "loss_mask"} - set(table.column_names)
    if missing:
        raise ValueError(f"tokenized shard lacks columns {sorted(missing)}")
    prompts = []
    for ids, mask in zip(table.column("input_ids").to_pylist(), table.column("loss_mask").to_pylist()):
        first = next((i for i, m in enumerate(mask) if m), None)
        if first:  # None: no reply; 0: nothing to condition on
            prompts.append(_clip(ids[:first], max_prompt_tokens))
        if len(prompts) == num_prompts:
            break
    if not prompts:
        raise ValueError("tokenized shard has no row with a prompt before its loss tokens")
    return prompts


def prompts_from_jsonl(data: bytes, *, num_prompts: int, max_prompt_tokens: int, tokenizer: Any = None) -> list[list[int]]:
    """Prompts of a JSONL file: `input_ids` lists, or `text` with a tokenizer."""
    prompts = []
    for number, line in enumerate(data.decode().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(f"prompt JSONL line {number} is not JSON: {error}") from None
        if isinstance(row, dict) and isinstance(row.get("input_ids"), list):
            ids = [int(i) for i in row["input_ids"]]
        elif isinstance(row, dict) and isinstance(row.get("text"), str):
            if tokenizer is None:
                raise ValueError(f"prompt JSONL line {number} has text but the target has no tokenizer")
            ids = tokenizer(row["text"], add_special_tokens=False)["input_ids"]
        else:
            raise ValueError(f"prompt JSONL line {number} needs 'input_ids' (list) or 'text' (string)")
        if ids:
            prompts.append(_clip(ids, max_prompt_tokens))
        if len(prompts) == num_prompts:
            break
    if not prompts:
        raise ValueError("prompt JSONL has no non-empty prompt")
    return prompts


def check_prompts(prompts: list[list[int]], *, vocab_size: int) -> None:
    for index, prompt in enumerate(prompts):
        if min(prompt) < 0 or max(prompt) >= vocab_size:
            raise ValueError(f"prompt {index} has token ids outside the target's {vocab_size}-token vocabulary")


def load_drafter_checkpoint(path: Path, *, device: str | torch.device = "cpu") -> torch.nn.Module:
    """A DFlashDraftModel (DFlash2DraftModel for a DFlash 2 run) from a training checkpoint dir
    (train_state.pt is not needed)."""
    path = Path(path)
    meta_path, model_path = path / CHECKPOINT_META_FILE, path / CHECKPOINT_MODEL_FILE
    if not meta_path.is_file() or not model_path.is_file():
        raise ValueError(f"checkpoint {path} needs {CHECKPOINT_MODEL_FILE} and {CHECKPOINT_META_FILE}")
    meta = json.loads(meta_path.read_text())
    if "drafter_config" not in meta:
        raise ValueError(f"{meta_path} has no drafter_config")
    # The loss it trained with rides along into exports; checkpoints before the LossSpec kept it in the config.
    loss = LossSpec.from_dict(meta.get("loss") or meta["drafter_config"])
    drafter = build_drafter(config_from_dict(meta["drafter_config"]), device=device, loss=loss)
    drafter.load_state_dict(load_file(model_path, device=str(device)), strict=True)
    return drafter
