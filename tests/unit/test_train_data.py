"""Packing, the resumable sampler, rank splits, shard validation and checkpoints.

Run: `.venv/bin/python -m pytest tests/unit/test_train_data.py -q`
"""

from __future__ import annotations

import json
import random
from itertools import islice

import numpy as np
import pyarrow as pa
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dflash_core.train.checkpoint import (
    capture_rng_state, complete_checkpoints, latest_checkpoint, load_checkpoint, restore_rng_state, save_checkpoint,
)
from dflash_core.train.data import (
    BadShard, PackedBatchSampler, collate, load_corpus, pack, pack_best_fit, read_shard_table, samples_with_loss,
    usable_samples,
)


def _table(lengths, *, start_token=1) -> pa.Table:
    ids = [list(range(start_token, start_token + n)) for n in lengths]
    masks = [[0] * (n // 2) + [1] * (n - n // 2) for n in lengths]
    return pa.table({
        "id": [f"s{i}" for i in range(len(lengths))],
        "input_ids": pa.array(ids, type=pa.list_(pa.uint32())),
        "loss_mask": pa.array(masks, type=pa.list_(pa.uint8())),
        "num_tokens": pa.array(lengths, type=pa.int32()),
    })


@given(st.lists(st.integers(1, 300), min_size=1, max_size=60), st.integers(64, 512), st.integers(0, 3))
@settings(max_examples=60, deadline=None)
def test_pack_covers_every_sample_once_within_budget(lengths, budget, seed) -> None:
    lengths = np.array(lengths)
    order = np.random.default_rng(seed).permutation(len(lengths))
    batches = pack(order, lengths, token_budget=budget)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    for batch in batches:
        assert sum(min(lengths[i], budget) for i in batch) <= budget


@given(st.lists(st.integers(1, 300), min_size=1, max_size=80), st.integers(64, 512), st.integers(0, 3),
       st.sampled_from([None, 1, 2, 3]), st.integers(1, 40))
@settings(max_examples=80, deadline=None)
def test_best_fit_covers_every_sample_once_within_budget(lengths, budget, seed, max_samples, window) -> None:
    lengths = np.array(lengths)
    order = np.random.default_rng(seed).permutation(len(lengths))
    batches = pack_best_fit(order, lengths, token_budget=budget, max_samples=max_samples, window=window,
                            rng=np.random.default_rng(seed))
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    for batch in batches:
        assert batch and sum(min(lengths[i], budget) for i in batch) <= budget
        assert max_samples is None or len(batch) <= max_samples
    # Samples meet only samples of their own window of the shuffled order.
    window_of = {int(index): position // window for position, index in enumerate(order)}
    assert all(len({window_of[i] for i in batch}) == 1 for batch in batches)


def test_best_fit_fills_rows_that_greedy_leaves_part_empty() -> None:
    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(np.log(1500), 0.9, size=4000), 16, 8192).astype(int)
    order = rng.permutation(len(lengths))

    def fill(batches) -> float:
        return float(np.mean([min(int(lengths[b].sum()), 8192) / 8192 for b in batches]))

    greedy, best = pack(order, lengths, token_budget=8192), pack_best_fit(order, lengths, token_budget=8192)
    assert fill(greedy) < 0.9 < 0.97 < fill(best)
    assert len(best) < len(greedy)


def test_sampler_resume_refuses_another_packing() -> None:
    lengths = np.random.default_rng(0).integers(20, 200, size=100)
    best = PackedBatchSampler(lengths, token_budget=512, seed=7)
    greedy = PackedBatchSampler(lengths, token_budget=512, seed=7, packing="greedy")
    assert best.epoch_batches(0) != greedy.epoch_batches(0)
    with pytest.raises(ValueError, match="packing='best_fit'.*resume with --set packing=best_fit"):
        greedy.load_state_dict(best.state_dict())
    old_state = {k: v for k, v in greedy.state_dict().items() if k != "packing"}  # a checkpoint from before
    greedy.load_state_dict(old_state)
    with pytest.raises(ValueError, match="packing='greedy'"):
        best.load_state_dict(old_state)
    with pytest.raises(ValueError, match="not one of"):
        PackedBatchSampler(lengths, token_budget=512, seed=7, packing="first_fit")


def test_one_sample_a_row_resumes_whatever_the_packing() -> None:
    """With max_samples_per_batch=1 (unpacked hybrid targets) both packings make the same batches, so a
    checkpoint from before best-fit (no packing key: greedy) resumes under the best_fit default."""
    lengths = np.random.default_rng(0).integers(20, 200, size=50)
    unpacked = PackedBatchSampler(lengths, token_budget=512, seed=7, max_samples_per_batch=1)
    old = PackedBatchSampler(lengths, token_budget=512, seed=7, max_samples_per_batch=1, packing="greedy")
    assert unpacked.epoch_batches(0) == old.epoch_batches(0)
    unpacked.load_state_dict({k: v for k, v in old.state_dict().items() if k != "packing"})
    packed = PackedBatchSampler(lengths, token_budget=512, seed=7)
    with pytest.raises(ValueError, match=r"this run packs one sample a row \(max_samples_per_batch=1\)"):
        unpacked.load_state_dict(packed.state_dict())


def test_best_fit_takes_unsigned_and_zero_lengths() -> None:
    """Lengths of any integer dtype: a zero among uint32 lengths must not shift every sample's length."""
    lengths = np.array([0, 51, 50, 50], dtype=np.uint32)
    batches = pack_best_fit(np.arange(4), lengths, token_budget=100)
    assert sorted(i for row in batches for i in row) == [0, 1, 2, 3]
    assert all(int(lengths[row].sum()) <= 100 for row in batches)


def test_collate_resets_positions_per_document() -> None:
    corpus = load_corpus([("a", _table([3, 4]))])
    batch = collate(corpus, [0, 1], token_budget=10)
    assert batch.input_ids.tolist() == [1, 2, 3, 1, 2, 3, 4, 0, 0, 0]
    assert batch.position_ids.tolist() == [0, 1, 2, 0, 1, 2, 3, 0, 0, 0]
    assert batch.document_ids.tolist() == [0, 0, 0, 1, 1, 1, 1, -1, -1, -1]
    assert batch.loss_mask.tolist() == [False, True, True, False, False, True, True, False, False, False]
    assert batch.num_real_tokens == 7


def test_sampler_state_round_trip_is_exact_mid_epoch() -> None:
    lengths = np.random.default_rng(0).integers(20, 200, size=300)
    sampler = PackedBatchSampler(lengths, token_budget=512, seed=7)
    list(islice(iter(sampler), len(sampler) + 5))  # crosses into epoch 1
    state = sampler.state_dict()
    assert state["epoch"] == 1 and state["batch_in_epoch"] == 5
    expected_next = list(islice(iter(sampler), 10))
    resumed = PackedBatchSampler(lengths, token_budget=512, seed=7)
    resumed.load_state_dict(json.loads(json.dumps(state)))
    assert list(islice(iter(resumed), 10)) == expected_next
    epoch0 = [i for batch in sampler.epoch_batches(0) for i in batch]
    assert sorted(epoch0) == list(range(300)), "one world: every sample once per epoch"


def test_sampler_differs_by_seed_and_epoch() -> None:
    lengths = np.full(100, 50)
    a = PackedBatchSampler(lengths, token_budget=200, seed=1)
    b = PackedBatchSampler(lengths, token_budget=200, seed=2)
    assert a.epoch_batches(0) != b.epoch_batches(0)
    assert a.epoch_batches(0) != a.epoch_batches(1)
    with pytest.raises(ValueError, match="seed"):
        b.load_state_dict(a.state_dict())


def test_ranks_get_disjoint_equal_shares() -> None:
    lengths = np.random.default_rng(1).integers(10, 100, size=500)
    shares = [PackedBatchSampler(lengths, token_budget=256, seed=3, rank=r, world_size=3).epoch_batches(0)
              for r in range(3)]
    assert len({len(s) for s in shares}) == 1
    seen = [i for share in shares for batch in share for i in batch]
    assert len(seen) == len(set(seen))


def test_bad_shard_names_the_shard(tmp_path) -> None:
    path = tmp_path / "shard-00003.arrow"
    wrong = pa.table({"input_ids": pa.array([[1, 2]], type=pa.list_(pa.int64())),
                      "loss_mask": pa.array([[1, 1]], type=pa.list_(pa.uint8())),
                      "num_tokens": pa.array([2], type=pa.int32())})
    with pa.ipc.new_file(str(path), wrong.schema) as writer:
        writer.write_table(wrong)
    with pytest.raises(BadShard, match=r"shard-00003.arrow: column 'input_ids' is list<item: int64>"):
        read_shard_table(path)
    (tmp_path / "junk.arrow").write_bytes(b"not arrow")
    with pytest.raises(BadShard, match="junk.arrow"):
        read_shard_table(tmp_path / "junk.arrow")
    mismatched = _table([3]).set_column(3, "num_tokens", pa.array([4], type=pa.int32()))
    with pytest.raises(BadShard, match="disagree"):
        load_corpus([("m.arrow", mismatched)])


def test_checkpoints_are_atomic_pruned_and_resumable(tmp_path) -> None:
    weights = {"fc.weight": torch.randn(4, 4)}
    for step in (10, 20, 30):
        save_checkpoint(tmp_path, step=step, model_state=weights, train_state={"step": step}, meta={"run": "r"},
                        keep_last=2)
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["step-000020", "step-000030"]
    (tmp_path / "step-000040").mkdir()  # a crash before meta.json: incomplete, ignored
    (tmp_path / "step-000040" / "model.safetensors").write_bytes(b"partial")
    assert latest_checkpoint(tmp_path).name == "step-000030"
    model_state, train_state, meta = load_checkpoint(latest_checkpoint(tmp_path))
    assert torch.equal(model_state["fc.weight"], weights["fc.weight"])
    assert train_state == {"step": 30} and meta["step"] == 30 and meta["run"] == "r"


def test_rng_state_round_trip() -> None:
    state = capture_rng_state()
    expected = (random.random(), np.random.rand(), torch.rand(1).item())
    restore_rng_state(state)
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected


# ---- quality-gate verdicts: the trainer trains only on shards whose gate passed -----------------------

def _gated_shard(path, *, verdict: str | None, lengths=(3, 4)):
    from dflash_core.data.verdict import GateVerdict
    from dflash_core.tokenize.io import arrow_bytes

    metadata = GateVerdict(verdict=verdict).arrow_metadata() if verdict else None
    path.write_bytes(arrow_bytes(_table(list(lengths)), metadata=metadata))
    return path


def _dataset_manifest(directory, *, shards, verdict: str):
    import hashlib

    from dflash_core.data.verdict import DatasetManifest, FailedCheck, GateVerdict

    checks = [FailedCheck(dataset="all", check="max_short_fraction", value=0.87, threshold=0.2,
                          message="all datasets: 87% of samples have <= 8 loss tokens")] if verdict == "failed" else []
    manifest = DatasetManifest(dataset="d", run="r", gate=GateVerdict(verdict=verdict, failed_checks=checks),
                               shards={p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in shards})
    (directory / "dataset.json").write_bytes(manifest.to_bytes())


def test_shards_without_a_passed_verdict_are_refused_by_name(tmp_path) -> None:
    from dflash_core.data.verdict import UnusableData
    from dflash_core.train.inputs import fetch_shards

    passed = _gated_shard(tmp_path / "ok.arrow", verdict="passed")
    unknown = _gated_shard(tmp_path / "plain.arrow", verdict=None)
    failed = _gated_shard(tmp_path / "bad.arrow", verdict="failed")
    assert fetch_shards([str(passed)], store=None, cache_dir=tmp_path) == [(passed, None)]
    with pytest.raises(UnusableData) as error:
        fetch_shards([str(passed), str(unknown), str(failed)], store=None, cache_dir=tmp_path)
    message = str(error.value)
    assert "2 of 3 shard(s) did not pass" in message and "ok.arrow" not in message
    assert f"{unknown}: no quality-gate verdict" in message and f"{failed}: quality gate failed" in message
    assert "allow_failed_quality_gate: true" in message


def test_the_dataset_manifest_decides_for_the_shards_it_lists(tmp_path) -> None:
    from dflash_core.data.verdict import UnusableData
    from dflash_core.train.inputs import fetch_shards

    shards = [_gated_shard(tmp_path / f"shard-0000{i}.arrow", verdict="pending", lengths=(3, 4 + i)) for i in range(2)]
    with pytest.raises(UnusableData, match="shard-00000.arrow: no quality-gate verdict \\(written by the tokenize flow"):
        fetch_shards([str(shards[0])], store=None, cache_dir=tmp_path)
    _dataset_manifest(tmp_path, shards=shards, verdict="failed")
    with pytest.raises(UnusableData, match=r"shard-00001.arrow: quality gate failed \(dataset.json of d/r\): "
                                           r"max_short_fraction: all datasets: 87% of samples"):
        fetch_shards([str(shards[1])], store=None, cache_dir=tmp_path)
    with pytest.warns(UserWarning) as caught:
        assert len(fetch_shards([str(s) for s in shards], store=None, cache_dir=tmp_path,
                                allow_failed_quality_gate=True)) == 2
    assert [str(w.message).split(": quality gate")[0] for w in caught] == \
        [f"allow_failed_quality_gate is set: training on {s}" for s in shards]
    _dataset_manifest(tmp_path, shards=shards, verdict="passed")
    assert len(fetch_shards([str(s) for s in shards], store=None, cache_dir=tmp_path)) == 2
    _gated_shard(shards[1], verdict="pending", lengths=(5,))  # re-tokenized after the gate ran
    with pytest.raises(UnusableData, match="shard-00001.arrow: no quality-gate verdict"):
        fetch_shards([str(s) for s in shards], store=None, cache_dir=tmp_path)


def _masked_table(masks: list[list[int]]) -> pa.Table:
    return pa.table({
        "id": [f"s{i}" for i in range(len(masks))],
        "input_ids": pa.array([list(range(1, len(m) + 1)) for m in masks], type=pa.list_(pa.uint32())),
        "loss_mask": pa.array(masks, type=pa.list_(pa.uint8())),
        "num_tokens": pa.array([len(m) for m in masks], type=pa.int32()),
    })


@given(st.lists(st.lists(st.integers(0, 1), max_size=40), min_size=1, max_size=30), st.integers(1, 45))
@settings(max_examples=60, deadline=None)
def test_loss_within_a_row_is_counted_on_what_the_row_keeps(masks, within) -> None:
    corpus = load_corpus([("a", _masked_table(masks))])
    assert samples_with_loss(corpus).tolist() == [any(m) for m in masks]
    assert samples_with_loss(corpus, within=within).tolist() == [any(m[:within]) for m in masks]


def test_samples_cropped_to_their_prompt_are_left_out_and_counted_apart() -> None:
    masks = [[0] * 8 + [1] * 2,   # its answer lies past a 6-token row: cropped
             [0] * 3 + [1] * 3,   # fits
             [0] * 5,             # no loss token anywhere
             [0] * 12 + [1]]      # cropped, the longest (13)
    corpus = load_corpus([("a", _masked_table(masks))])
    usable, left_out = usable_samples(corpus, token_budget=6)
    assert usable.tolist() == [False, True, False, False]
    assert (left_out.total, left_out.no_loss, left_out.cropped, left_out.kept) == (4, 1, 2, 1)
    message = left_out.message()
    assert message.startswith("training leaves out 3 of 4 samples: 1 with no loss token")
    assert "2 whose loss tokens all lie past the first 6 tokens" in message
    assert "raise token_budget to 13 (their longest)" in message
    assert usable_samples(corpus, token_budget=13)[1].message() == \
        "training leaves out 1 of 4 samples: 1 with no loss token (nothing to learn from)"
    sampler = PackedBatchSampler(corpus.lengths, token_budget=6, seed=0, drop_samples_without_loss=~usable)
    for epoch in range(3):  # every row of every epoch holds a loss token within what it keeps
        for batch in sampler.epoch_batches(epoch):
            assert batch == [1]


def test_training_warns_of_what_it_leaves_out_and_refuses_data_with_nothing_left(capsys) -> None:
    from dflash_core.data.verdict import UnusableData
    from dflash_core.train.assemble import _usable_samples

    corpus = load_corpus([("a", _masked_table([[0] * 8 + [1] * 2, [0] * 2 + [1] * 2]))])
    assert _usable_samples(corpus, token_budget=6, log=True).tolist() == [False, True]
    assert "warning: training leaves out 1 of 2 samples: 1 whose loss tokens" in capsys.readouterr().err
    _usable_samples(corpus, token_budget=6, log=False)
    assert capsys.readouterr().err == "", "only rank 0 says it"
    with pytest.raises(UnusableData, match="raise token_budget to 10"):
        _usable_samples(load_corpus([("a", _masked_table([[0] * 8 + [1] * 2]))]), token_budget=6, log=True)


def test_loss_tokens_past_a_rows_end_are_counted_and_named_above_one_percent() -> None:
    masks = [[0] * 2 + [1] * 8,   # 10 tokens: a 6-token row keeps 4 of its 8 loss tokens
             [0] * 2 + [1] * 2]   # fits
    corpus = load_corpus([("a", _masked_table(masks))])
    usable, left_out = usable_samples(corpus, token_budget=6)
    assert usable.tolist() == [True, True] and (left_out.loss_tokens, left_out.tail_loss_tokens) == (10, 4)
    assert left_out.message() == ("1 of 2 samples are longer than a row's 6 tokens and lose their tail: 40.0% "
                                  "of the data's loss tokens lie past a row's end and are never trained on; "
                                  "token_budget 10 (the longest of them) keeps them")
    # a sample left out whole is said once, in the left-out line, not again as a tail
    only_cropped = load_corpus([("a", _masked_table([[0] * 8 + [1] * 2, [0] * 2 + [1] * 2]))])
    assert usable_samples(only_cropped, token_budget=6)[1].message().count("samples") == 1
    many = [[0, 1]] * 200 + [[0, 1, 1]]  # 1 of 202 loss tokens past a 2-token row: under 1%, not worth a line
    _, small = usable_samples(load_corpus([("a", _masked_table(many))]), token_budget=2)
    assert small.tail_loss_fraction == pytest.approx(1 / 202) and small.message() is None
