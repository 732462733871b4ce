"""The acceptance bench's data-scaling curve: jobs per data multiplier, nested training subsets, the
report grouped by (variant, steps, multiplier) with the first size reaching a tau, the PNG; and batched
greedy generation equal to one prompt at a time.

Run: .venv/bin/python -m pytest tests/unit/test_bench_acceptance_scaling.py -q
"""

import json

import pytest

from bench.acceptance import run as acceptance



def test_jobs_are_planned_per_multiplier_and_say_it():
    args = acceptance.parse_args(["--suite", "core", "--seeds", "0", "--long-multiplier", "0",
                             "--data-multipliers", "1", "2", "4", "8"])
    jobs = acceptance.plan_jobs(args, acceptance.resolve_shape(args), acceptance.resolve_rows(args))
    assert len(jobs) == 3 * 4
    assert {(j.variant, j.data_multiplier) for j in jobs} == {(v, m) for v in ["speculators", "speculators-dflash2",
                                                                               "default"] for m in (1, 2, 4, 8)}
    assert [j.data_multiplier for j in jobs[:3]] == [8, 8, 8]  # the curve's far end first
    assert jobs[0].label == "speculators@200s0x8data" and len({j.run_name for j in jobs}) == len(jobs)
    from dflash_core.train.config import TrainConfig

    TrainConfig(run_name=jobs[0].run_name, target="embedded", data=["x"])  # a valid run name
    legacy = acceptance.plan_jobs(acceptance.parse_args(["--suite", "core", "--seeds", "0", "--long-multiplier", "0"]),
                             acceptance.resolve_shape(args), ["default"])
    assert legacy == [acceptance.Job("default", 0, 200)] and not hasattr(legacy[0], "data_multiplier")


def test_the_pool_caps_the_largest_multiplier():
    from bench.acceptance import scaling

    lines = []
    assert scaling.cap_multipliers([1, 2, 4, 8], available=7762, base=1024, log=lines.append) == [1, 2, 4, 7]
    assert "DATA POOL TOO SMALL" in lines[0] and "7x (7,168 completions)" in lines[0]
    assert scaling.cap_multipliers([4, 1, 2], available=9000, base=1024, log=lines.append) == [1, 2, 4]
    assert len(lines) == 1


class _Tokenizer:
    def apply_chat_template(self, messages, **kwargs):
        return list(range(len(messages[0]["content"].split())))


def test_training_subsets_are_nested_and_the_worker_takes_its_multiple(tmp_path):
    from bench.acceptance import data
    from bench.acceptance import worker

    pool = [(f"sharegpt:{i}", f"prompt {i} " + "word " * (i % 5)) for i in range(400)]
    shape = acceptance.Shape(train_prompts=50, eval_prompts=2, max_prompt_tokens=8)
    one_x, held, _ = data.scaled_prompts(pool, _Tokenizer(), shape, None)
    train, held_too, sizes = data.scaled_prompts(pool, _Tokenizer(), shape, [1, 2, 4, 8], log=lambda _: None)
    assert train[:50] == one_x and held_too == held  # 1x is today's set; the held-out prompts are unchanged
    assert sizes == [1, 2, 4, 7] and len(train) == 7 * 50  # the pool holds 391 training prompts
    records = [{"id": i, "prompt": ids, "completion": [1, 2]} for i, ids in train]
    chunks = [tmp_path / "chunk-a.json", tmp_path / "chunk-b.json"]  # what prepare_data's index names
    chunks[0].write_text(json.dumps(records[:120]))
    chunks[1].write_text(json.dumps(records[120:]))
    (tmp_path / "data.json").write_text(json.dumps({"chunks": [str(path) for path in chunks]}))
    worker.WORKER.update(data_path=str(tmp_path / "data.json"), shape={"train_prompts": 50})
    try:
        corpora = {m: worker.corpus_for_worker(m) for m in sizes}
        assert [len(corpora[m].names) for m in sizes] == [50, 100, 200, 350]
        for small, big in zip(sizes, sizes[1:]):
            assert corpora[big].names[: len(corpora[small].names)] == corpora[small].names
        assert len(worker.corpus_for_worker().names) == 350  # no multiplier: every completion
    finally:
        worker.WORKER.clear()


def _result(variant, seed, tau, multiplier, *, steps=200):
    return {"variant": variant, "seed": seed, "steps": steps, "tau": tau, "acceptance_per_position": [0.5, 0.25],
            "tau_by_source": {"sharegpt": tau, "own": None}, "train_tau": 1.5, "steps_per_s": 10.0,
            "wall_s": 60.0, "train_s": 20.0, "eval_s": 30.0, "all_match_target": True, "mask_token_id": 16,
            "target_layer_ids": [1, 27], "data_multiplier": multiplier, "train_completions": 1024 * multiplier}


def test_report_groups_by_multiplier_finds_thresholds_and_draws_the_png(tmp_path):
    from bench.acceptance import report
    from bench.acceptance import scaling

    results = [_result("default", 0, 1.3, 1), _result("default", 1, 1.4, 1), _result("default", 0, 1.6, 2),
               _result("default", 0, 1.9, 4), _result("default", 0, 2.1, 8),
               _result("speculators", 0, 1.2, 1), _result("speculators", 0, 1.5, 8)]
    rows = report.aggregate(results, variant_order=list(acceptance.variants()))
    assert [(r["variant"], r["data_multiplier"]) for r in rows] == [
        ("default", 1), ("default", 2), ("default", 4), ("default", 8), ("speculators", 1), ("speculators", 8)]
    assert rows[0]["tau_mean"] == pytest.approx(1.35) and rows[0]["seeds"] == [0, 1]
    assert rows[3]["gain_vs_speculators"] == pytest.approx(1.1 / 0.5)  # against speculators at the same size
    curves = scaling.curves(rows)
    assert scaling.first_reaching(curves[("default", "200")], 1.5)["data_multiplier"] == 2
    assert scaling.first_reaching(curves[("default", "200")], 2.0)["data_multiplier"] == 8
    assert scaling.first_reaching(curves[("speculators", "200")], 1.5)["train_completions"] == 8192
    assert scaling.first_reaching(curves[("speculators", "200")], 2.0) is None
    text = report.write_report(tmp_path, results, header="h", variant_order=list(acceptance.variants()))
    assert "| default | 200 | 1.350 / 0.350 (n 2) | 1.600 / 0.600 (n 1) | 1.900 / 0.900 (n 1) | " \
           "2.100 / 1.100 (n 1) | 2x (2,048) | 8x (8,192) |" in text
    assert "| speculators | 200 | 1.200 / 0.200 (n 1) | - | - | 1.500 / 0.500 (n 1) | 8x (8,192) | not reached |" in text
    assert "| default | 200 | 4x (4,096) | 1 | 1.900 +- 0.000 |" in text and "--data-multipliers 4`" in text
    assert (tmp_path / "scaling.md").read_text().startswith("Data scaling")
    png = (tmp_path / "scaling.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 1000
    assert "scaling.png" in (tmp_path / "table.md").read_text()


def test_a_table_without_multipliers_has_no_data_column(tmp_path):
    from bench.acceptance import report

    results = [{k: v for k, v in _result("default", 0, 1.3, 1).items()
                if k not in ("data_multiplier", "train_completions")}]
    rows = report.aggregate(results)
    assert "data_multiplier" not in rows[0]
    text = report.write_report(tmp_path, results, header="h", variant_order=[])
    assert "| variant | steps | n | tau |" in text and "Data scaling" not in text
    assert not (tmp_path / "scaling.png").exists()


def _tiny_model():
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    return transformers.LlamaForCausalLM(config).eval()


def test_batched_greedy_generation_equals_one_prompt_at_a_time():
    import random

    from bench.acceptance import completions

    from dflash_core.evaluate import greedy_decode

    model = _tiny_model()
    rng = random.Random(0)
    prompts = [(f"p{i}", [rng.randrange(3, 64) for _ in range(rng.randrange(1, 12))]) for i in range(9)]
    reference = [greedy_decode(model, ids, max_new_tokens=20).tokens for _, ids in prompts]
    eos = reference[2][4]  # a token some rows reach early, so rows end at different steps
    reference = [greedy_decode(model, ids, max_new_tokens=20, eos_token_id=eos).tokens for _, ids in prompts]
    assert any(len(r) < 20 for r in reference) and any(len(r) == 20 for r in reference)
    for batch_size, static_width in ((1, None), (4, None), (16, None), (4, 12), (16, 12)):
        # static_width: fixed-shape batches (pad rows, left padding to 12) on a static cache: the same tokens
        records = completions.greedy_completions(model, prompts, max_new_tokens=20, eos_id=eos, pad_id=0,
                                          batch_size=batch_size, static_width=static_width)
        assert [r["id"] for r in records] == [i for i, _ in prompts]  # prompt order, whatever the batching
        assert [r["completion"] for r in records] == reference, (batch_size, static_width)
    with pytest.raises(ValueError, match="wider than static_width 4"):
        completions.greedy_completions(model, prompts, max_new_tokens=2, eos_id=eos, pad_id=0, batch_size=4, static_width=4)
    every_row_ends = [(i, ids) for (i, ids), r in zip(prompts, reference) if len(r) < 20]
    records = completions.greedy_completions(model, every_row_ends, max_new_tokens=20, eos_id=eos, pad_id=0,
                                      batch_size=8)  # every row of the batch ends at its EOS
    assert [r["completion"] for r in records] == [r for r in reference if len(r) < 20]


def test_the_pool_takes_first_turns_first_then_later_turns_held_out_with_their_conversation(tmp_path):
    import gzip

    from bench.acceptance import data

    def turns(*pairs):
        return [{"from": pair[0], "value": pair[1]} if isinstance(pair, tuple) else pair for pair in pairs]

    records = [
        {"id": "a_0", "conversations": turns(("human", "first question of a"), ("gpt", "answer"),
                                              ("human", "a follow-up question of a"), ("gpt", "x"),
                                              ("human", "short"))},  # < 16 characters: left out
        {"id": "a_1", "conversations": turns(("gpt", "the split part starts with the assistant"),
                                              ("human", "a question in the second part of a"))},
        {"id": "b_0", "conversations": turns(("human", "first question of b"),
                                              ("human", "first question of a"),  # a first turn's text: once
                                              "not a turn")},
        {"id": "c_0", "conversations": turns(("human", "a follow-up question of a"))},  # first turn wins
    ]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(records))
    pool = data.sharegpt_pool(100, path=path)
    assert pool == [("sharegpt:a_0", "first question of a"), ("sharegpt:b_0", "first question of b"),
                    ("sharegpt:c_0", "a follow-up question of a"),
                    ("sharegpt:a_1#t1", "a question in the second part of a")]
    assert data.sharegpt_pool(2, path=path) == pool[:2]

    # A held-out conversation's later turns never train, also from its other split records.
    stem = next(f"s{i}" for i in range(10_000) if data.held_out(f"sharegpt:s{i}_0")
                and not data.held_out(f"sharegpt:s{i}_1"))
    assert data.held_out(f"sharegpt:{stem}_1#t3") and not data.held_out(f"sharegpt:{stem}_1")
    kept = next(f"k{i}" for i in range(10_000) if not any(data.held_out(f"sharegpt:k{i}_{p}") for p in (0, 1)))
    assert not data.held_out(f"sharegpt:{kept}_1#t3")

    (tmp_path / "b").mkdir()
    with gzip.open(tmp_path / "b" / "prompts.jsonl.gz", "wt") as handle:
        handle.writelines(json.dumps({"id": i, "text": t}) + "\n" for i, t in pool)
    assert data.load_pool(tmp_path) == pool and data.load_pool(tmp_path, limit=1) == pool[:1]


def test_completions_are_cached_by_chunk_and_a_deadline_keeps_what_was_generated(tmp_path):
    import random
    import time

    from bench.acceptance import completions

    model = _tiny_model()
    rng = random.Random(1)
    prompts = [(f"p{i}", [rng.randrange(3, 64) for _ in range(rng.randrange(1, 9))]) for i in range(7)]
    whole = completions.greedy_completions(model, prompts, max_new_tokens=6, eos_id=1, pad_id=0, batch_size=16)
    common = dict(work=tmp_path, max_new_tokens=6, eos_id=1, pad_id=0, batch_size=2, tag="float32", chunk=3)
    logged = []
    assert completions.cached_completions(model, prompts[:6], log=logged.append, **common) == whole[:6]
    assert len(logged) == 2 and len(list((tmp_path / "completions").glob("chunk-*.json"))) == 2
    with pytest.raises(SystemExit, match="2 of 3 chunks"):  # the grown list keeps both chunks; the third waits
        completions.cached_completions(model, prompts, stop_at=time.time() - 1, log=logged.append, **common)
    assert len(logged) == 2
    assert completions.cached_completions(model, prompts, log=logged.append, **common) == whole
    assert len(logged) == 3 and not list((tmp_path / "completions").glob("*.tmp"))
    # the workers read the chunks through an index (prepare_data's), not a second copy of the corpus
    paths = completions.chunk_files(prompts, work=tmp_path, max_new_tokens=6, tag="float32", chunk=3)
    assert all(path.is_file() for path in paths) and len(paths) == 3
    (tmp_path / "index.json").write_text(json.dumps({"chunks": [str(path) for path in paths]}))
    assert completions.read_completions(tmp_path / "index.json") == whole


def test_completions_generated_on_one_machine_are_taken_on_the_next(tmp_path):
    """The chunks generated now are also written, gzipped, into one tar archive in --out; another machine,
    without that --work, takes them from the unpacked copy
    instead of generating them again."""
    import random
    import tarfile

    from bench.acceptance import completions

    model = _tiny_model()
    rng = random.Random(2)
    prompts = [(f"p{i}", [rng.randrange(3, 64) for _ in range(rng.randrange(1, 9))]) for i in range(5)]
    common = dict(max_new_tokens=6, eos_id=1, pad_id=0, batch_size=2, tag="float32", chunk=3)
    archive = tmp_path / "OUT" / "completions.tar"
    first = completions.cached_completions(model, prompts, work=tmp_path / "first", export=archive,
                                    log=lambda _: None, **common)
    assert [p.name for p in archive.parent.iterdir()] == ["completions.tar"]
    with tarfile.open(archive) as tar:
        assert sorted(tar.getnames()) == sorted(f"{p.name}.gz" for p in completions.chunk_files(
            prompts, work=tmp_path / "first", max_new_tokens=6, tag="float32", chunk=3))
        tar.extractall(tmp_path / "out", filter="data")  # what `tar -xf completions.tar -C` does here

    class _NoGeneration:
        def parameters(self):
            raise AssertionError("a carried chunk was generated again")

    logged = []
    again = completions.cached_completions(_NoGeneration(), prompts, work=tmp_path / "next", carried=tmp_path / "out",
                                    log=logged.append, **common)
    assert again == first and len(logged) == 2 and all("taken from" in line for line in logged)
    # a chunk the carried folder lacks is generated, the others taken
    second = completions.chunk_files(prompts, work=tmp_path, max_new_tokens=6, tag="float32", chunk=3)[1]
    (tmp_path / "out" / f"{second.name}.gz").unlink()
    logged.clear()
    assert completions.cached_completions(model, prompts, work=tmp_path / "third", carried=tmp_path / "out",
                                   log=logged.append, **common) == first
    assert ["taken from" in line for line in logged] == [True, False]


def test_held_out_baselines_are_decoded_once_per_work_dir(tmp_path):
    from bench.acceptance import completions

    from dflash_core.evaluate import greedy_decode

    model = _tiny_model()
    prompts = [("a", [5, 9, 3]), ("b", [7, 2])]
    common = dict(work=tmp_path, max_new_tokens=5, eos_id=1, tag="float32:tiny")
    logged = []
    first = completions.cached_baselines(model, prompts, log=logged.append, **common)
    assert [row["baseline"] for row in first] == [greedy_decode(model, p, max_new_tokens=5, eos_token_id=1).tokens
                                                  for _, p in prompts]
    assert [row["id"] for row in first] == ["a", "b"] and not logged
    assert completions.cached_baselines(model, prompts, log=logged.append, **common) == first  # the next run reads them
    assert len(logged) == 1 and "earlier run" in logged[0]
    # other prompts, length or target: decoded again, beside the first
    completions.cached_baselines(model, prompts[:1], log=logged.append, **{**common, "tag": "bfloat16:tiny"})
    assert len(logged) == 1 and len(list(tmp_path.glob("baselines-*.json"))) == 2
