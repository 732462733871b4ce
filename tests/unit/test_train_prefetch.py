"""Batches prepared on a background thread: the same training, errors raised where the loop runs,
the thread gone on every exit; metrics synced per log window equal their eager means; the e2e bench's
profile mode on a CPU.

Run: `.venv/bin/python -m pytest tests/unit/test_train_prefetch.py -q`
"""

from __future__ import annotations

import json
import threading
import time
import traceback
from types import SimpleNamespace

import pytest
import torch

from dflash_core.train import loop, prefetch, strategies
from dflash_core.train.assemble import build_trainer
from dflash_core.train.loop import Trainer
from dflash_core.train.prefetch import THREAD_NAME, BatchPrefetcher
from tests.unit.test_trainer import tiny_config


def _prefetch_threads() -> list[threading.Thread]:
    return [thread for thread in threading.enumerate() if thread.name == THREAD_NAME]


def _records(trainer: Trainer) -> list[dict]:
    rows = [json.loads(x) for x in trainer.run_dir.joinpath("metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in row.items() if k != "tokens_per_s"} for row in rows]


def test_prefetch_on_and_off_train_identically(tmp_path) -> None:
    from dflash_core.train.checkpoint import load_checkpoint

    changes = dict(max_steps=6, log_every=1, checkpoint_every=3, optim={"lr": 1e-2, "warmup_steps": 2, "grad_accum": 2})
    runs = {}
    for depth in (0, 1, 3):
        trainer = build_trainer(tiny_config(tmp_path / f"depth{depth}", **changes, prefetch_batches=depth))
        trainer.run()
        runs[depth] = (trainer, _records(trainer))
        assert trainer.sampler.state_dict()["batch_in_epoch"] == 12  # rewound to what was trained on
    plain, plain_records = runs[0]
    for depth in (1, 3):
        trainer, records = runs[depth]
        assert records == plain_records
        for (name, ours), theirs in zip(trainer.drafter.state_dict().items(), plain.drafter.state_dict().values()):
            assert torch.equal(ours, theirs), name
        _, train_state, _ = load_checkpoint(trainer.run_dir / "checkpoints" / "step-000003")
        assert train_state["sampler"]["batch_in_epoch"] == 6
    assert not _prefetch_threads()


def test_checkpoint_records_the_trained_on_batches_not_the_queued_ones(tmp_path) -> None:
    from dflash_core.train.checkpoint import load_checkpoint

    trainer = build_trainer(tiny_config(tmp_path, max_steps=3, checkpoint_every=3, prefetch_batches=4))
    result = trainer.run()
    _, train_state, _ = load_checkpoint(result.checkpoint)
    assert train_state["sampler"]["batch_in_epoch"] == 3


def test_an_error_while_preparing_a_batch_is_raised_in_the_loop(tmp_path, monkeypatch) -> None:
    calls = {"n": 0}
    real_collate = prefetch.collate

    def failing_collate(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise ValueError("sample 17 is corrupt")
        return real_collate(*args, **kwargs)

    monkeypatch.setattr(prefetch, "collate", failing_collate)
    trainer = build_trainer(tiny_config(tmp_path, max_steps=5, log_every=1, checkpoint_every=100, prefetch_batches=2))
    with pytest.raises(ValueError, match="sample 17 is corrupt") as caught:
        trainer.run()
    frames = [frame.name for frame in traceback.extract_tb(caught.value.__traceback__)]
    assert "failing_collate" in frames and "prepare" in frames  # the thread's own traceback
    assert trainer.step == 2  # the two batches prepared before the error were trained on
    assert not _prefetch_threads()


def test_the_thread_is_joined_when_the_step_fails(tmp_path, monkeypatch) -> None:
    real_step = strategies.drafter_step

    def failing_step(*args, **kwargs):
        if trainer.step == 1:
            raise RuntimeError("CUDA out of memory (simulated)")
        return real_step(*args, **kwargs)

    monkeypatch.setattr(strategies, "drafter_step", failing_step)
    trainer = build_trainer(tiny_config(tmp_path, max_steps=5, checkpoint_every=100, prefetch_batches=2))
    with pytest.raises(RuntimeError, match="simulated"):
        trainer.run()
    assert not _prefetch_threads()
    assert trainer.sampler.state_dict()["batch_in_epoch"] == 2  # rewound past the queued batches


def test_close_stops_a_producer_blocked_on_a_full_queue() -> None:
    made = []

    def prepare():
        made.append(len(made))
        return made[-1]

    prefetcher = BatchPrefetcher(prepare, depth=1)
    assert prefetcher.next() == 0
    time.sleep(0.2)  # the producer fills the queue and blocks on the next put
    started = time.perf_counter()
    prefetcher.close()
    assert not prefetcher.alive and time.perf_counter() - started < 2


def test_logged_window_equals_the_eager_mean_of_its_steps(tmp_path) -> None:
    trainer = build_trainer(tiny_config(tmp_path, max_steps=7, log_every=3, checkpoint_every=100, prefetch_batches=2))
    eager: dict[int, dict] = {}
    trainer.run(on_step=lambda *, step, metrics, timing: eager.__setitem__(
        step, {name: value.double().tolist() for name, value in metrics.items()}))
    records = [json.loads(x) for x in trainer.run_dir.joinpath("metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [3, 6, 7]
    for record, steps in zip(records, ([1, 2, 3], [4, 5, 6], [7])):
        assert record["window"]["steps"] == len(steps)
        for name in ("loss", "acceptance_length", "grad_norm", "accuracy_per_position"):
            mean = torch.tensor([eager[s][name] for s in steps], dtype=torch.float64).mean(0)
            assert torch.allclose(torch.tensor(record["window"][name], dtype=torch.float64), mean, rtol=1e-6), name
            assert record[name] == eager[steps[-1]][name]  # the last step's value, read exactly


def test_ranks_agree_on_a_stop_only_every_n_steps(monkeypatch) -> None:
    calls = []

    def all_reduce(flag, op=None):
        calls.append(flag)

    monkeypatch.setattr(loop.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(loop.dist, "all_reduce", all_reduce)
    fake = SimpleNamespace(dist=SimpleNamespace(world_size=2), stop_check_every=4, _stop_requested=True,
                           drafter_device=torch.device("cpu"), step=0)
    agreed = []
    for step in range(9):
        fake.step = step
        agreed.append(Trainer._stop_agreed(fake))
    assert len(calls) == 3 and agreed == [s % 4 == 0 for s in range(9)]


def test_bench_profile_runs_on_cpu(tmp_path) -> None:
    from bench.training import loop

    out, trace = tmp_path / "row.json", tmp_path / "trace.json.gz"
    row = loop.main(["--tiny", "--profile", "--json", str(out), "--profile-out", str(trace)])
    saved = json.loads(out.read_text())
    assert saved["ms_per_step"] == row["ms_per_step"] > 0 and len(saved["per_step_ms"]) == 3
    assert saved["host_prepare_ms"] >= 0 and saved["settings"]["prefetch"] == 2
    phases = saved["profile"]["phases"]
    assert phases["dflash.drafter_step"]["host_ms"] > 0 and phases["dflash.target_forward"]["host_ms"] > 0
    assert trace.exists() and trace.with_name("trace.txt").read_text().count("\n") > 25
    host_ops = saved["profile"]["top_host_ops"]  # the host's time op by op, most first
    assert host_ops and all(op["self_host_ms_per_step"] >= 0 and op["calls_per_step"] > 0 for op in host_ops)
    assert [op["self_host_ms_per_step"] for op in host_ops] == sorted((op["self_host_ms_per_step"] for op in host_ops),
                                                                     reverse=True)
    assert not _prefetch_threads()


def test_prefetch_and_stop_check_are_config_fields(tmp_path) -> None:
    trainer = build_trainer(tiny_config(tmp_path, max_steps=1, prefetch_batches=0, stop_check_every=3))
    trainer.steps.open()
    assert isinstance(trainer.steps.batches, prefetch.InlineBatches) and trainer.stop_check_every == 3
    trainer.steps.close()
    trainer.close()
    with pytest.raises(ValueError, match="prefetch_batches"):
        tiny_config(tmp_path, prefetch_batches=-1)


def test_step_timing_gives_each_part_in_ms_a_step() -> None:
    from dflash_core.train.strategies import StepTiming

    timings = [StepTiming(prepare_s=0.001, dispatch_s=0.010), StepTiming(prepare_s=0.003, dispatch_s=0.020, wait_s=0.004)]
    assert StepTiming.mean_ms(timings) == pytest.approx({"prepare": 2.0, "dispatch": 15.0, "wait": 2.0})
    assert StepTiming.mean_ms([]) == {}
