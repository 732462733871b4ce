"""The evaluator's CUDA-graph harness on a GPU: the graphs are captured and replayed, and in fp32 every
token and every round's accepted length equals the eager harness's. Skipped without CUDA.

Run (any CUDA GPU): python3 -m pytest tests/gpu/test_evaluate_gpu.py -q --noconftest
"""

import warnings

import pytest
import torch

from dflash_core.evaluate import GraphedDecoder, SpeculativeDecoder, evaluate_prompts, greedy_decode
from dflash_core.model import DFlashConfig
from dflash_core.model.build import build_drafter
from dflash_core.target import build_target, target_heads, tiny_target_config

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _models(dtype):
    torch.manual_seed(0)
    config = tiny_target_config("qwen3", num_layers=6)
    target = build_target(config, device=torch.device("cuda"), dtype=dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        drafter_config = DFlashConfig.from_target(config, num_layers=1, block_size=4, num_tapped_layers=2)
    drafter = build_drafter(drafter_config, device="cuda").to(dtype)
    drafter.attach_target(target_heads(target))
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, config.vocab_size, (n,), generator=generator).tolist() for n in (7, 40)]
    return target, drafter, prompts


def test_captured_graphs_decode_exactly_as_the_eager_harness_in_fp32():
    target, drafter, prompts = _models(torch.float32)
    graphed = GraphedDecoder(target=target, drafter=drafter, capacity=128)
    assert graphed._step.graph is not None and graphed._verify.graph is not None and graphed._draft.graph is not None
    eager = SpeculativeDecoder(target=target, drafter=drafter)
    for prompt in prompts:
        reference = greedy_decode(target, prompt, max_new_tokens=32)
        assert graphed.greedy(prompt, max_new_tokens=32).tokens == reference.tokens
        want, got = eager.generate(prompt, max_new_tokens=32), graphed.generate(prompt, max_new_tokens=32)
        assert got.tokens == want.tokens == reference.tokens and got.accepted == want.accepted
        assert got.draft_s > 0 and got.verify_s > 0  # CUDA events between the replays


def test_auto_takes_graphs_on_a_gpu_and_reports_it_in_bf16():
    target, drafter, prompts = _models(torch.bfloat16)
    report = evaluate_prompts(target=target, drafter=drafter, prompts=prompts, modes=("block",), max_new_tokens=16)
    summary = report["summaries"][0]
    assert summary["harness"] == "graphs" and summary["num_responses"] == 2 and summary["tokens_per_s"] > 0
