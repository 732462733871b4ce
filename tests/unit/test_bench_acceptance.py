"""The acceptance bench's bookkeeping: held-out prompts never train, the table aggregates seeds and
compares tau - 1 with speculators' rows, rows and jobs are planned as asked, speculators' mask rule.

Run: .venv/bin/python -m pytest tests/unit/test_bench_acceptance.py -q
"""


import dataclasses

import pytest

from bench.acceptance import run as acceptance



class _Tokenizer:
    def apply_chat_template(self, messages, **kwargs):
        return list(range(len(messages[0]["content"].split())))


def test_held_out_prompts_never_train():
    from bench.acceptance import data

    pool = [(f"sharegpt:{i}", f"prompt number {i} " + "word " * (i % 7)) for i in range(2000)]
    pool.append(("sharegpt:dup", pool[0][1]))  # ShareGPT repeats texts under other ids
    shape = acceptance.Shape(train_prompts=300, eval_prompts=10, max_prompt_tokens=8)
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


def test_table_aggregates_seeds_and_compares_tau_minus_one_with_both_speculators_rows():
    from bench.acceptance import report

    results = [_result("default", 0, 2.0, acc=(0.5, 0.25)), _result("default", 1, 2.4, acc=(0.7, 0.35)),
               _result("speculators", 0, 2.0), _result("speculators-dflash2", 0, 1.8),
               _result("default", 1, 9.9)]  # a seed merged in twice counts once: its first result
    rows = report.aggregate(results, variant_order=list(acceptance.variants()))
    assert [r["variant"] for r in rows] == ["default", "speculators", "speculators-dflash2"]
    assert [r["variant"] for r in report.aggregate(results, variant_order=["speculators"])][0] == "speculators"
    default = rows[0]
    assert default["tau_mean"] == pytest.approx(2.2) and default["tau_sd"] == pytest.approx(0.2828, abs=1e-4)
    assert default["gain_mean"] == pytest.approx(1.2) and default["gain_sd"] == default["tau_sd"]
    assert default["acceptance_per_position"] == pytest.approx([0.6, 0.3])
    assert default["acceptance_per_position_sd"] == pytest.approx([0.1414, 0.0707], abs=1e-4)
    assert default["gain_vs_speculators"] == pytest.approx(1.2)  # (2.2 - 1) / (2.0 - 1), not 2.2 / 2.0
    assert default["gain_vs_speculators-dflash2"] == pytest.approx(1.5)  # 1.2 / 0.8
    text = report.table(rows, command="python -m bench.acceptance")
    assert "| default | 200 | 2 | 2.200 +- 0.283 | 1.200 +- 0.283 | 0.600 +- 0.141 | 0.300 +- 0.071 | - | - | " \
           "1.200x | 1.500x |" in text
    assert "| speculators | 200 | 1 | 2.000 +- 0.000 | 1.000 +- 0.000 |" in text and "| 1.000x | 1.250x |" in text
    assert "--variants default --seeds 0 1 --steps 200" in text
    estimate = report.wall_estimate(rows, steps=2000)
    assert "default (measured at 200 steps): ~240 s a job at 2000 steps (40 s setup + evaluation" in estimate



def test_rows_on_larger_steps_are_their_own_rows_compared_within_their_step_size():
    from bench.acceptance import report

    results = [_result("default", 0, 2.0), _result("speculators", 0, 1.5),  # no token_budget recorded: 2,048
               {**_result("default", 0, 1.9, steps=50), "token_budget": 8192},
               {**_result("speculators", 0, 1.6, steps=50), "token_budget": 8192}]
    rows = report.aggregate(results, variant_order=list(acceptance.variants()))
    assert [(r["variant"], r["steps"], r["token_budget"]) for r in rows] == [
        ("default", 200, 2048), ("speculators", 200, 2048), ("default", 50, 8192), ("speculators", 50, 8192)]
    assert rows[2]["gain_vs_speculators"] == pytest.approx(0.9 / 0.6), "against the 8,192-token speculators row"
    text = report.table(rows, command="python -m bench.acceptance --workers 2")
    assert "| default | 50 x 8,192 tokens | 1 |" in text and "| default | 200 | 1 |" in text
    assert "--variants default --seeds 0 --steps 50 --token-budget 8192 --long-multiplier 0" in text
    assert report.row_command(["run", "--token-budget", "8192", "--anchors", "300"]) == \
        "python -m bench.acceptance --anchors 300", "the row says its own token budget"


def test_a_token_budget_alone_keeps_the_anchor_density():
    shape = acceptance.resolve_shape(acceptance.parse_args(["--token-budget", "8192"]))
    assert (shape.token_budget, shape.num_anchors) == (8192, 512)
    shape = acceptance.resolve_shape(acceptance.parse_args(["--token-budget", "8192", "--anchors", "300"]))
    assert shape.num_anchors == 300
    assert acceptance.resolve_shape(acceptance.parse_args(["--tiny", "--token-budget", "512"])).num_anchors == 32

def test_a_schedule_lever_is_compared_with_the_speculators_rows_of_its_own_schedule():
    """default+lr=3e-4 against speculators+lr=3e-4 when that ran; a lever the speculators rows cannot
    share (dropout) and a schedule without its speculators rows fall back to the plain rows."""
    from bench.acceptance import report

    results = [_result("speculators", 0, 1.5), _result("speculators-dflash2", 0, 1.6),
               _result("speculators+lr=3e-4", 0, 1.4), _result("speculators-dflash2+lr=3e-4", 0, 1.8),
               _result("default+lr=3e-4", 0, 2.0), _result("default+dropout=0.1", 0, 2.0),
               _result("default+lr=1.2e-3", 0, 2.0)]
    rows = {r["variant"]: r for r in report.aggregate(results, variant_order=list(acceptance.variants()))}
    assert rows["default+lr=3e-4"]["gain_vs_speculators"] == pytest.approx(1.0 / 0.4)
    assert rows["default+lr=3e-4"]["gain_vs_speculators-dflash2"] == pytest.approx(1.0 / 0.8)
    assert rows["default+dropout=0.1"]["gain_vs_speculators"] == pytest.approx(1.0 / 0.5)
    assert rows["default+lr=1.2e-3"]["reference_speculators"] == "speculators"  # its rows did not run
    text = report.table(list(rows.values()), command="python -m bench.acceptance")
    assert "own AdamW schedule, the others' to the plain speculators rows: default+lr=3e-4, " in text
    assert "default+dropout=0.1" not in text.split("references:")[1]


def test_rows_come_from_the_suite_then_the_list_and_jobs_are_long_first_then_seed_major():
    args = acceptance.parse_args(["--suite", "core", "--variants", "default,dflash", "--seeds", "0", "1",
                             "--long-variants", "default", "--long-seeds", "0"])
    names = acceptance.resolve_rows(args)
    assert names == ["speculators", "speculators-dflash2", "default", "dflash"]
    jobs = acceptance.plan_jobs(args, acceptance.resolve_shape(args), names)
    assert [j.label for j in jobs[:2]] == ["default@2000s0", "speculators@200s0"]
    assert [j.seed for j in jobs[1:]] == [0] * 4 + [1] * 4
    with pytest.raises(SystemExit, match="unknown variants"):
        acceptance.resolve_rows(acceptance.parse_args(["--variants", "nope"]))


def test_no_job_starts_after_the_deadline():
    import time

    acceptance.WORKER.update(deadline_at=time.time() - 1)
    try:
        assert acceptance.run_job(acceptance.Job("default", 0, 200)) is None  # returns before building anything
    finally:
        acceptance.WORKER.clear()


def test_speculators_mask_token_follows_its_trainer_and_says_which_rule():
    from bench.acceptance import speculators as spec

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


def test_speculators_rows_take_their_own_recipe_only():
    """Their model and loss stay speculators'; the AdamW schedule they run on is shared, so a schedule
    lever can run on every recipe (the `schedule` suite), but not another optimizer."""
    with pytest.raises(ValueError, match="AdamW schedule"):
        acceptance.Variant("x", "x", kind="speculators", optim={"optimizer": "muon"})
    with pytest.raises(ValueError, match="AdamW schedule"):
        acceptance.Variant("x", "x", kind="speculators", drafter={"loss_type": "kl"})
    shared = acceptance.variants()["speculators-dflash2+lr=1.2e-3"]
    assert shared.kind == "speculators-dflash2" and shared.optim == {"lr": 1.2e-3}
    with pytest.raises(ValueError, match="kind"):
        acceptance.Variant("x", "x", kind="speculators-eagle")
    with pytest.raises(ValueError, match="mask"):
        acceptance.Variant("x", "x", mask="eos")


def test_every_variant_is_a_valid_run_and_levers_must_reach_the_drafter():
    from dflash_core.model import DFlashConfig
    from dflash_core.train.config import TrainConfig

    for variant in acceptance.variants().values():
        TrainConfig(run_name=acceptance.Job(variant.name, 0, 200).run_name, target="embedded", data=["x"],
                    drafter=variant.drafter, optim=variant.optim)
    for suite in acceptance.SUITES.values():
        assert set(suite) <= set(acceptance.variants())
    config = TrainConfig(target="embedded", data=["x"], drafter=acceptance.variants()["default+noise=0.2"].drafter)
    built = DFlashConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, vocab_size=256, target_layer_ids=[1, 2], mask_token_id=5, block_size=8)
    default_loss = TrainConfig(target="embedded", data=["x"]).drafter.loss_spec()
    with pytest.raises(RuntimeError, match="loss_spec"):
        acceptance.check_recipe_applied(config, built, default_loss)  # a trainer that dropped the lever: refused
    acceptance.check_recipe_applied(config, built, config.drafter.loss_spec())
    tapped = TrainConfig(target="embedded", data=["x"], drafter=acceptance.variants()["default+last-tap=N-2"].drafter)
    assert tapped.drafter.target_layer_ids == [1, 8, 14, 20, 28]
    with pytest.raises(RuntimeError, match="tapping"):
        acceptance.check_recipe_applied(tapped, built, tapped.drafter.loss_spec())  # [1, 2] built, [1, ..., 28] asked
    two = TrainConfig(target="embedded", data=["x"], drafter=acceptance.variants()["default+taps=2"].drafter)
    on_smollm2 = dataclasses.replace(built, target_layer_ids=[1, 8, 14, 20, 27], target_num_layers=30)
    with pytest.raises(RuntimeError, match="tapping"):  # a tap count the trainer dropped: the default's 5 built
        acceptance.check_recipe_applied(two, on_smollm2, two.drafter.loss_spec())
    acceptance.check_recipe_applied(config, on_smollm2, config.drafter.loss_spec())


def test_the_bench_evaluates_alike_in_both_harnesses_and_says_which_ran():
    from bench.acceptance import worker

    from dflash_core.evaluate import greedy_decode
    from tests.unit.test_evaluate_speculative import _overfit, _setup

    target, drafter, prompts = _setup("llama", num_drafter_layers=1)
    _overfit(target, drafter, prompts, steps=60)  # long enough acceptances that a bookkeeping slip would show
    eval_set = [{"id": f"sharegpt:{i}" if i else "own-code-1", "prompt": p,
                 "baseline": greedy_decode(target, p, max_new_tokens=12).tokens, "baseline_wall_s": 0.1}
                for i, p in enumerate(prompts)]
    saved = dict(worker.WORKER)
    try:
        rows = {}
        for harness in ("eager", "graphs"):
            worker.WORKER.update(eval_target=target, eval_set=eval_set, eval_new_tokens=12, eos_id=None,
                                 eval_harness=harness)
            rows[harness] = worker.evaluate_drafter(drafter)
    finally:
        worker.WORKER.clear()
        worker.WORKER.update(saved)
    assert rows["eager"]["eval_harness"] == "eager" and rows["graphs"]["eval_harness"] == "graphs"
    assert rows["eager"]["all_match_target"] and rows["graphs"]["all_match_target"]
    for key in ("tau", "acceptance_per_position", "num_rounds", "tau_by_source"):
        assert rows["graphs"][key] == rows["eager"][key], key
    assert rows["eager"]["tau"] > 1.5


def test_a_speculators_job_resumes_where_its_saved_state_left_off(tmp_path):
    from bench.acceptance import speculators as spec
    from bench.acceptance import worker
    import torch

    def loop():
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 2)
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + s))
        return model, optimizer, scheduler, iter([torch.full((3, 4), float(i)) for i in range(6)])

    def train(model, optimizer, scheduler, batches, steps):
        for _ in range(steps):
            model(next(batches)).square().mean().backward()
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()

    path = tmp_path / "job.speculators.pt"
    saved = dict(worker.WORKER)
    try:
        worker.WORKER.update(resume=True)
        reference = loop()
        train(*reference, steps=5)
        first = loop()
        train(*first, steps=3)
        spec._save(path, model=first[0], optimizer=first[1], scheduler=first[2], step=3)
        model, optimizer, scheduler, batches = loop()  # a new process: fresh model, batches from the start
        assert spec._resume(path, model=model, optimizer=optimizer, scheduler=scheduler,
                            batches=batches) == (3, None)
        train(model, optimizer, scheduler, batches, steps=2)
        assert torch.equal(model.weight, reference[0].weight) and scheduler.last_epoch == 5
        # Trained to the end, then the run stopped in evaluation: the next run takes the trained weights and the
        # training's figures, and trains no step again.
        figures = {"train_s": 12.5, "steps_per_s": 3.1, "resumed_from_step": 0, "train_loss": 1.5, "train_tau": 1.7}
        spec._save(path, model=model, optimizer=optimizer, scheduler=scheduler, step=5, trained=figures)
        again = loop()
        assert spec._resume(path, model=again[0], optimizer=again[1], scheduler=again[2],
                            batches=again[3]) == (5, figures)
        assert torch.equal(again[0].weight, reference[0].weight) and again[2].last_epoch == 5
        worker.WORKER["resume"] = False  # without --resume a saved state is ignored
        assert spec._resume(path, model=model, optimizer=optimizer, scheduler=scheduler,
                            batches=batches) == (0, None)
    finally:
        worker.WORKER.clear()
        worker.WORKER.update(saved)


def test_the_ablation_rows_change_one_part_each_and_the_structural_ones_keep_the_draft_cost():
    """Every `ablate` row is a valid run config, and the structural rows cost what the default
    costs per drafted token (layer parameters within 1%; taps only grow the context projection)."""
    import torch

    from bench.acceptance import variants as rows
    from dflash_core.model import build_drafter
    from dflash_core.target import real_shape_config
    from dflash_core.train.config import TrainConfig
    from dflash_core.train.drafter_setup import drafter_config_for

    known = rows.variants()
    assert all(name in known for name in rows.SUITES["ablate"])
    target = real_shape_config("smollm2-135m")

    def built(name: str):
        variant = known[name]
        config = TrainConfig(run_name="ablate", target="embedded", data=["<in-memory>"], optim=variant.optim,
                             drafter={"num_layers": 2, "block_size": 8, "mask_token_id": 5, **variant.drafter})
        drafter_config = drafter_config_for(config, target_config=target)
        with torch.device("meta"):
            drafter = build_drafter(drafter_config)
        return drafter_config, sum(p.numel() for n, p in drafter.named_parameters() if n.startswith("layers."))

    (default, default_layers), (narrow, narrow_layers) = built("default"), built("default+layers=3+narrow")
    five = [1, 8, 14, 20, 27]  # the default's taps on the 30-layer SmolLM2
    assert (narrow.num_layers, narrow.intermediate_size, narrow.target_layer_ids) == (3, rows.NARROW_MLP, five)
    assert default.target_layer_ids == five and abs(narrow_layers / default_layers - 1) < 0.01
    taps, taps_layers = built("default+taps=2")
    assert taps.target_layer_ids == [1, 27] and taps_layers == default_layers
    assert built("default+taps=speculators")[0].target_layer_ids == list(rows.SPECULATORS_TAPS)
    for name in rows.SUITES["ablate"]:
        if known[name].kind == "ours":
            built(name)


def test_a_narrow_mlp_cannot_start_from_the_targets_layers():
    from dflash_core.target import real_shape_config
    from dflash_core.train.config import TrainConfig
    from dflash_core.train.drafter_setup import drafter_config_for

    config = TrainConfig(run_name="narrow", target="embedded", data=["<in-memory>"],
                         drafter={"intermediate_size": 816, "init": "target", "mask_token_id": 5})
    with pytest.raises(ValueError, match="intermediate_size 816 with drafter.init 'target'.*1536 wide"):
        drafter_config_for(config, target_config=real_shape_config("smollm2-135m"))


@pytest.mark.parametrize("shape_name, default_anchors, speculators_anchors", [("FULL", 512, 128), ("TINY", 64, 16)])
def test_a_variants_anchors_keep_their_density_at_the_tiny_shape(tmp_path, shape_name, default_anchors,
                                                                 speculators_anchors):
    """Variants give anchors per 2,048-token row; the tiny smoke's 256-token rows get the same density (512 anchors
    on a 256-token row would be more anchors than tokens, and a 5-minute smoke)."""
    import dataclasses

    from bench.acceptance import variants as rows
    from bench.acceptance import worker

    shape = getattr(rows, shape_name)
    worker.WORKER.update(shape=dataclasses.asdict(shape), attention="sdpa", device="cpu")
    try:
        known = rows.variants()
        job = rows.Job("default", 0, 4)
        assert worker.train_config(job, known["default"], tmp_path).drafter.num_anchors == default_anchors
        assert worker.train_config(job, known["speculators"], tmp_path).drafter.num_anchors == speculators_anchors
    finally:
        worker.WORKER.clear()



@pytest.mark.slow
def test_a_job_whose_run_stopped_in_evaluation_resumes_trained_and_reports_its_training(tmp_path, monkeypatch):
    from bench.acceptance import worker

    saved = dict(worker.WORKER)  # the in-process worker's state (its corpus, target) must not reach other tests
    try:
        _run_stops_in_evaluation_then_resumes(tmp_path, monkeypatch)
    finally:
        worker.WORKER.clear()
        worker.WORKER.update(saved)


def _run_stops_in_evaluation_then_resumes(tmp_path, monkeypatch):
    """A run stopped after a job trained but before its row is written (stopped in evaluation): the next run
    with --resume evaluates the finished checkpoint and reports the first run's training figures,
    not a fresh 0-step run; the run's files go once the row is written."""
    import json

    from bench.acceptance import ours as acceptance_ours

    argv = ["--tiny", "--out", str(tmp_path / "out"), "--models-dir", str(tmp_path / "models"), "--workers", "1",
            "--checkpoint-every", "2", "--variants", "default"]

    def run_stops(drafter):
        raise SystemExit("the run ended in evaluation")

    evaluate = acceptance_ours.evaluate_drafter
    monkeypatch.setattr(acceptance_ours, "evaluate_drafter", run_stops)
    with pytest.raises(SystemExit, match="ended in evaluation"):
        acceptance.main(argv)
    run_dir = tmp_path / "out" / "work" / "runs" / "default-4s0"
    trained = json.loads((run_dir / "trained.json").read_text())
    assert trained["resumed_from_step"] == 0 and trained["train_s"] > 0
    monkeypatch.setattr(acceptance_ours, "evaluate_drafter", evaluate)
    acceptance.main([*argv, "--resume"])
    (row,) = [json.loads(line) for line in (tmp_path / "out" / "results.jsonl").read_text().splitlines()]
    assert row["variant"] == "default" and row["all_match_target"]
    assert {key: row[key] for key in trained} == trained  # the first run's training, not a 0-step rerun
    assert not run_dir.exists()
    # where the main thread spent the steps after the first log (4 steps logged every step: 3 of them)
    assert row["host_dispatch_ms"] > 0 and row["host_prepare_ms"] >= 0 and isinstance(row["compiled_graphs"], int)
    from bench.acceptance.report import host_text

    assert host_text(row).startswith("; host ms/step: prepare ") and host_text({"tau": 1.5}) == ""
