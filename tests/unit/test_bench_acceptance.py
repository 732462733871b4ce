"""The acceptance bench's bookkeeping: held-out prompts never train, the table aggregates seeds and
compares tau - 1 with speculators' rows, rows and jobs are planned as asked, speculators' mask rule.

Run: .venv/bin/python -m pytest tests/unit/test_bench_acceptance.py -q
"""


import pytest



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


def _result(variant, seed, tau, *, steps=200, acc=(0.5, 0.25)):
    return {"variant": variant, "seed": seed, "steps": steps, "tau": tau, "acceptance_per_position": list(acc),
            "tau_by_source": {"sharegpt": tau, "own": None}, "train_tau": 1.5, "steps_per_s": 10.0,
            "wall_s": 60.0, "train_s": 20.0, "eval_s": 30.0, "all_match_target": True, "mask_token_id": 16,
            "target_layer_ids": [1, 27]}


def test_table_aggregates_seeds_and_compares_tau_minus_one_with_both_speculators_rows(bench):
    import acceptance_report as report

    results = [_result("default", 0, 2.0, acc=(0.5, 0.25)), _result("default", 1, 2.4, acc=(0.7, 0.35)),
               _result("speculators", 0, 2.0), _result("speculators-dflash2", 0, 1.8),
               _result("default", 1, 9.9)]  # a seed merged in twice counts once: its first result
    rows = report.aggregate(results, variant_order=list(bench.variants()))
    assert [r["variant"] for r in rows] == ["default", "speculators", "speculators-dflash2"]
    assert [r["variant"] for r in report.aggregate(results, variant_order=["speculators"])][0] == "speculators"
    default = rows[0]
    assert default["tau_mean"] == pytest.approx(2.2) and default["tau_sd"] == pytest.approx(0.2828, abs=1e-4)
    assert default["gain_mean"] == pytest.approx(1.2) and default["gain_sd"] == default["tau_sd"]
    assert default["acceptance_per_position"] == pytest.approx([0.6, 0.3])
    assert default["acceptance_per_position_sd"] == pytest.approx([0.1414, 0.0707], abs=1e-4)
    assert default["gain_vs_speculators"] == pytest.approx(1.2)  # (2.2 - 1) / (2.0 - 1), not 2.2 / 2.0
    assert default["gain_vs_speculators-dflash2"] == pytest.approx(1.5)  # 1.2 / 0.8
    text = report.table(rows, command="python bench/bench_acceptance.py")
    assert "| default | 200 | 2 | 2.200 +- 0.283 | 1.200 +- 0.283 | 0.600 +- 0.141 | 0.300 +- 0.071 | - | - | " \
           "1.200x | 1.500x |" in text
    assert "| speculators | 200 | 1 | 2.000 +- 0.000 | 1.000 +- 0.000 |" in text and "| 1.000x | 1.250x |" in text
    assert "--variants default --seeds 0 1 --steps 200" in text
    estimate = report.wall_estimate(rows, steps=2000)
    assert "default (measured at 200 steps): ~240 s a job at 2000 steps (40 s setup + evaluation" in estimate


def test_a_schedule_lever_is_compared_with_the_speculators_rows_of_its_own_schedule(bench):
    """default+lr=3e-4 against speculators+lr=3e-4 when that ran; a lever the speculators rows cannot
    share (dropout) and a schedule without its speculators rows fall back to the plain rows."""
    import acceptance_report as report

    results = [_result("speculators", 0, 1.5), _result("speculators-dflash2", 0, 1.6),
               _result("speculators+lr=3e-4", 0, 1.4), _result("speculators-dflash2+lr=3e-4", 0, 1.8),
               _result("default+lr=3e-4", 0, 2.0), _result("default+dropout=0.1", 0, 2.0),
               _result("default+lr=1.2e-3", 0, 2.0)]
    rows = {r["variant"]: r for r in report.aggregate(results, variant_order=list(bench.variants()))}
    assert rows["default+lr=3e-4"]["gain_vs_speculators"] == pytest.approx(1.0 / 0.4)
    assert rows["default+lr=3e-4"]["gain_vs_speculators-dflash2"] == pytest.approx(1.0 / 0.8)
    assert rows["default+dropout=0.1"]["gain_vs_speculators"] == pytest.approx(1.0 / 0.5)
    assert rows["default+lr=1.2e-3"]["reference_speculators"] == "speculators"  # its rows did not run
    text = report.table(list(rows.values()), command="python bench/bench_acceptance.py")
    assert "own AdamW schedule, the others' to the plain speculators rows: default+lr=3e-4, " in text
    assert "default+dropout=0.1" not in text.split("references:")[1]


def test_rows_come_from_the_suite_then_the_list_and_jobs_are_long_first_then_seed_major(bench):
    args = bench.parse_args(["--suite", "core", "--variants", "default,dflash", "--seeds", "0", "1",
                             "--long-variants", "default", "--long-seeds", "0"])
    names = bench.resolve_rows(args)
    assert names == ["speculators", "speculators-dflash2", "default", "dflash"]
    jobs = bench.plan_jobs(args, bench.resolve_shape(args), names)
    assert [j.label for j in jobs[:2]] == ["default@2000s0", "speculators@200s0"]
    assert [j.seed for j in jobs[1:]] == [0] * 4 + [1] * 4
    with pytest.raises(SystemExit, match="unknown variants"):
        bench.resolve_rows(bench.parse_args(["--variants", "nope"]))


def test_no_job_starts_after_the_deadline(bench):
    import time

    bench.WORKER.update(deadline_at=time.time() - 1)
    try:
        assert bench.run_job(bench.Job("default", 0, 200)) is None  # returns before building anything
    finally:
        bench.WORKER.clear()


def test_speculators_mask_token_follows_its_trainer_and_says_which_rule(bench):
    import acceptance_speculators as spec

    class Tokenizer:
        def __init__(self, size, mask=None, pad=2, eos=2):
            self.size, self.mask_token_id, self.pad_token_id, self.eos_token_id, self.unk_token_id = \
                size, mask, pad, eos, None

        def __len__(self):
            return self.size

    assert spec.speculators_mask_token(Tokenizer(100, mask=7), 128) == (7, "tokenizer")
    assert spec.speculators_mask_token(Tokenizer(100), 128) == (100, "added")  # its new <|MASK|> row
    assert spec.speculators_mask_token(Tokenizer(128), 128) == (2, "fallback:pad_token_id")  # SmolLM2's case
    assert spec.speculators_mask_token(Tokenizer(128, pad=None), 128) == (2, "fallback:eos_token_id")


def test_speculators_rows_take_their_own_recipe_only(bench):
    """Their model and loss stay speculators'; the AdamW schedule they run on is shared, so a schedule
    lever can run on every recipe (the `schedule` suite), but not another optimizer."""
    with pytest.raises(ValueError, match="AdamW schedule"):
        bench.Variant("x", "x", kind="speculators", optim={"optimizer": "muon"})
    with pytest.raises(ValueError, match="AdamW schedule"):
        bench.Variant("x", "x", kind="speculators", drafter={"loss_type": "kl"})
    shared = bench.variants()["speculators-dflash2+lr=1.2e-3"]
    assert shared.kind == "speculators-dflash2" and shared.optim == {"lr": 1.2e-3}
    with pytest.raises(ValueError, match="kind"):
        bench.Variant("x", "x", kind="speculators-eagle")
    with pytest.raises(ValueError, match="mask"):
        bench.Variant("x", "x", mask="eos")


def test_every_variant_is_a_valid_run_and_levers_must_reach_the_drafter(bench):
    from dflash_core.model import DFlashConfig
    from dflash_core.train.config import TrainConfig

    for variant in bench.variants().values():
        TrainConfig(run_name=bench.Job(variant.name, 0, 200).run_name, target="embedded", data=["x"],
                    drafter=variant.drafter, optim=variant.optim)
    for suite in bench.SUITES.values():
        assert set(suite) <= set(bench.variants())
    config = TrainConfig(target="embedded", data=["x"], drafter=bench.variants()["default+noise=0.2"].drafter)
    built = DFlashConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, vocab_size=256, target_layer_ids=[1, 2], mask_token_id=5, block_size=8)
    default_loss = TrainConfig(target="embedded", data=["x"]).drafter.loss_spec()
    with pytest.raises(RuntimeError, match="loss_spec"):
        bench.check_recipe_applied(config, built, default_loss)  # a trainer that dropped the lever: refused
    bench.check_recipe_applied(config, built, config.drafter.loss_spec())
    tapped = TrainConfig(target="embedded", data=["x"], drafter=bench.variants()["default+last-tap=N-2"].drafter)
    assert tapped.drafter.target_layer_ids == [1, 28]
    with pytest.raises(RuntimeError, match="tapping"):
        bench.check_recipe_applied(tapped, built, tapped.drafter.loss_spec())  # [1, 2] built, [1, 28] asked
