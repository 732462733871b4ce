"""The acceptance bench's bookkeeping: held-out prompts never train, the table aggregates seeds.

Run: .venv/bin/python -m pytest tests/unit/test_bench_acceptance.py -q
"""

import importlib.util
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "bench" / "bench_acceptance.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_acceptance", _PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_acceptance"] = module
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop("bench_acceptance", None)


class _Tokenizer:
    def apply_chat_template(self, messages, **kwargs):
        return list(range(len(messages[0]["content"].split())))


def test_held_out_prompts_never_train(bench):
    import acceptance_data as data  # bench/, on the path once the bench is loaded

    pool = [(f"sharegpt:{i}", f"prompt number {i} " + "word " * (i % 7)) for i in range(2000)]
    pool.append(("sharegpt:dup", pool[0][1]))  # ShareGPT repeats texts under other ids
    shape = bench.Shape(train_prompts=300, eval_prompts=10, max_prompt_tokens=8)
    train, evaluation = data.split_prompts(pool[:-1], _Tokenizer(), shape)
    assert len(train) == 300 and len(evaluation) == 10 + len(data.OWN_PROMPTS)
    assert all(data.held_out(i) for i, _ in evaluation[:10]) and not any(data.held_out(i) for i, _ in train)
    assert all(len(ids) <= 8 for _, ids in train)
    with pytest.raises(SystemExit, match="held-out"):
        data.split_prompts(pool[:50], _Tokenizer(), shape)


def test_table_aggregates_seeds_and_compares_with_speculators(bench):
    import acceptance_report as report

    def result(variant, seed, tau):
        return {"variant": variant, "seed": seed, "steps": 200, "tau": tau, "acceptance_per_position": [0.5, 0.25],
                "tau_by_source": {"sharegpt": tau, "own": None}, "train_tau": 1.5, "steps_per_s": 10.0,
                "all_match_target": True, "mask_token_id": 16, "target_layer_ids": [1, 27]}

    results = [result("default", 0, 2.0), result("default", 1, 2.4), result("speculators", 0, 2.0)]
    rows = report.aggregate(results, variant_order=list(bench.variants()))
    assert [r["variant"] for r in rows] == ["default", "speculators"]
    assert [r["variant"] for r in report.aggregate(results, variant_order=["speculators"])] == ["speculators", "default"]
    assert rows[0]["tau_mean"] == pytest.approx(2.2) and rows[0]["tau_sd"] == pytest.approx(0.2828, abs=1e-4)
    text = report.table(rows, command="python bench/bench_acceptance.py")
    assert "| default | 200 | 2.200 +- 0.283 (n=2) | 1.10x |" in text
    assert "--variants default --seeds 0 1 --steps 200" in text


def test_every_variant_is_a_valid_run_and_levers_must_reach_the_drafter(bench):
    from dflash_core.model import DFlashConfig
    from dflash_core.train.config import TrainConfig

    for variant in bench.variants().values():
        drafter = {k: (None if v == "ours" else v) for k, v in variant.drafter.items()}
        TrainConfig(target="embedded", data=["x"], drafter=drafter, optim=variant.optim)
    config = TrainConfig(target="embedded", data=["x"], drafter=bench.variants()["default+noise=0.2"].drafter)
    built = DFlashConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, vocab_size=256, target_layer_ids=[1, 2], mask_token_id=5, block_size=8)
    with pytest.raises(RuntimeError, match="drafter_training_fields"):
        bench.check_recipe_applied(config, built)  # a trainer that dropped the lever: refused, not measured
    bench.check_recipe_applied(config, built.__class__(**{**built.__dict__, "feature_noise": 0.2}))
