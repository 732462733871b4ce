"""Evaluation inputs: prompts from tokenized shards and JSONL, drafters from training checkpoints,
and the report's statistics on known rounds.

Run: .venv/bin/python -m pytest tests/unit/test_evaluate_inputs.py -q
"""

import warnings

import pyarrow as pa
import pytest
import torch

from dflash_core.evaluate.inputs import (
    check_prompts, load_drafter_checkpoint, prompts_from_jsonl, prompts_from_tokenized,
)
from dflash_core.evaluate.report import ResponseResult, plot_acceptance, summarize
from dflash_core.evaluate.speculative import Decoded
from dflash_core.model import DFlashConfig
from dflash_core.model.build import build_drafter
from dflash_core.target import tiny_target_config
from dflash_core.tokenize.io import arrow_bytes


def test_tokenized_prompt_is_everything_before_the_first_loss_token():
    table = pa.table({
        "input_ids": [[5, 6, 7, 8, 9], [1, 2, 3], [4, 4, 4, 4]],
        "loss_mask": [[0, 0, 0, 1, 1], [0, 0, 0], [0, 1, 1, 1]],
    })
    prompts = prompts_from_tokenized(arrow_bytes(table), num_prompts=10, max_prompt_tokens=2)
    assert prompts == [[6, 7], [4]]  # row 2 has no reply; clipped to the last 2 tokens
    with pytest.raises(ValueError, match="lacks columns"):
        prompts_from_tokenized(arrow_bytes(pa.table({"input_ids": [[1]]})), num_prompts=1, max_prompt_tokens=4)


def test_jsonl_prompts_and_their_errors():
    data = b'{"input_ids": [1, 2, 3]}\n\n{"input_ids": [4]}\n{"input_ids": [5]}\n'
    assert prompts_from_jsonl(data, num_prompts=2, max_prompt_tokens=8) == [[1, 2, 3], [4]]
    with pytest.raises(ValueError, match="line 1 has text but the target has no tokenizer"):
        prompts_from_jsonl(b'{"text": "hi"}\n', num_prompts=1, max_prompt_tokens=8)
    with pytest.raises(ValueError, match="line 1 is not JSON"):
        prompts_from_jsonl(b"{cut\n", num_prompts=1, max_prompt_tokens=8)
    with pytest.raises(ValueError, match="outside"):
        check_prompts([[1, 300]], vocab_size=256)


def test_drafter_loads_from_a_training_checkpoint(tmp_path):
    from dflash_core.train.checkpoint import save_checkpoint

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = DFlashConfig.from_target(tiny_target_config("qwen3"), num_layers=1, block_size=4,
                                          num_tapped_layers=2)
    drafter = build_drafter(config)
    path = save_checkpoint(tmp_path, step=3, model_state=drafter.state_dict(), train_state={},
                           meta={"drafter_config": config.to_dict()}, keep_last=1)
    loaded = load_drafter_checkpoint(path)
    assert loaded.config == config
    assert all(torch.equal(t, loaded.state_dict()[n]) for n, t in drafter.state_dict().items())
    with pytest.raises(ValueError, match="needs model.safetensors"):
        load_drafter_checkpoint(tmp_path / "missing")


def test_tau_is_averaged_per_response_then_over_responses(tmp_path):
    results = [
        ResponseResult(0, 5, Decoded(tokens=[1] * 9, accepted=[3, 3], wall_s=1.0, num_target_forwards=3), 2.0, True),
        ResponseResult(1, 5, Decoded(tokens=[1] * 5, accepted=[0, 0, 1, 0], wall_s=1.0, num_target_forwards=5), 2.0,
                       True),
    ]
    summary = summarize(results, block_size=4, mode="block")
    assert summary["tau"] == pytest.approx((4.0 + 1.25) / 2)  # not the per-round mean (13 / 6)
    assert summary["tau_histogram"] == {"1": 3, "2": 1, "3": 0, "4": 2}
    assert summary["acceptance_per_position"] == pytest.approx([3 / 6, 2 / 6, 2 / 6])
    assert summary["speedup"] == pytest.approx(2.0) and summary["tokens_per_s"] == pytest.approx(7.0)
    assert plot_acceptance([summary], tmp_path / "a.png").read_bytes()[:4] == b"\x89PNG"
