"""How one generation is dealt over several nodes (dflash_core/serving/shares.py) and the rules of generate's
`nodes` form (flows/generate.py, flows/generate_nodes.py): deterministic, proportional shares that cover
every shard once; per-node settings only on the nodes; one model and engine on every node.

Run: `.venv/bin/python -m pytest -q -n 0 tests/unit/test_generation_shares.py`
"""

from __future__ import annotations

import pytest

from dflash_core.serving.shares import check_shares, split_by_weight

SHARDS = [f"prompts-{i:05d}.jsonl" for i in range(10)] + ["heldout-00000.jsonl", "heldout-00001.jsonl"]


def test_shares_follow_the_instances_and_never_change_for_the_same_input():
    shares = split_by_weight(SHARDS, {"a": 1, "b": 3})
    assert [len(shares["a"]), len(shares["b"])] == [3, 9]  # 12 shards at 1:3
    assert shares == split_by_weight(SHARDS, {"a": 1, "b": 3})
    check_shares(SHARDS, shares)
    even = split_by_weight(SHARDS, {"a": 2, "b": 2, "c": 2})
    assert [len(s) for s in even.values()] == [4, 4, 4]
    assert [s[-1] for s in even.values()] == ["prompts-00009.jsonl", "heldout-00000.jsonl", "heldout-00001.jsonl"]


@pytest.mark.parametrize("weights", [{"a": 1, "b": 2, "c": 5}, {"a": 7}, {"a": 3, "b": 1}, {"a": 1, "b": 1}])
@pytest.mark.parametrize("count", [0, 1, 5, 13, 100])
def test_every_share_is_within_one_shard_of_its_quota(weights, count):
    items = [f"s{i}" for i in range(count)]
    shares = split_by_weight(items, weights)
    check_shares(items, shares)
    total = sum(weights.values())
    for name, share in shares.items():
        assert abs(len(share) - count * weights[name] / total) < 1 + 1e-9, (name, len(share))
    assert list(shares) == list(weights)  # a node with nothing to do is still listed


def test_bad_splits_and_weights_are_named():
    with pytest.raises(ValueError, match="no node"):
        split_by_weight(SHARDS, {})
    with pytest.raises(ValueError, match="positive weight.*'b': 0"):
        split_by_weight(SHARDS, {"a": 1, "b": 0})
    with pytest.raises(ValueError, match="listed twice: \\['x'\\]"):
        split_by_weight(["x", "y", "x"], {"a": 1})
    with pytest.raises(ValueError, match="more than one node: {'x': \\['a', 'b'\\]}"):
        check_shares(["x", "y"], {"a": ["x"], "b": ["x", "y"]})
    with pytest.raises(ValueError, match="given to no node: \\['y'\\]"):
        check_shares(["x", "y"], {"a": ["x"]})
    with pytest.raises(ValueError, match="not among the shards: \\['z'\\]"):
        check_shares(["x"], {"a": ["x", "z"]})


def _form(**changes) -> dict:
    nodes = [{"provision": {"node": {"name": "gpu-a", "backend": "local", "work_dir": "/tmp/a"}}, "num_instances": 4,
              "devices": ["0", "1", "2", "3"]},
             {"provision": {"node_name": "gpu-b", "inventory": "nodes.yaml"}, "base_port": 8200}]
    return {"dataset": "d", "run": "r", "engine": {"engine": "vllm", "model": "/models/qwen"}, "nodes": nodes,
            **changes}


def test_a_form_across_nodes_keeps_per_node_settings_on_the_nodes():
    from flows.generate import GenerateParams

    params = GenerateParams.model_validate(_form())
    assert [spec.num_instances for spec in params.nodes] == [4, 1]
    # the UI sends every field, defaults included: those are not per-node settings given twice
    assert GenerateParams.model_validate(params.model_dump(mode="json")) == params
    for field, value in (("devices", ["0"]), ("num_instances", 2), ("base_port", 9000),
                         ("node", {"name": "x", "backend": "local"}), ("prompt_shards", ["k"])):
        with pytest.raises(ValueError, match=f"with nodes, set {field} on each node"):
            GenerateParams.model_validate(_form(**{field: value}))


def test_a_form_across_nodes_names_its_engine_and_each_node_once():
    from flows.generate import GenerateParams

    with pytest.raises(ValueError, match="with nodes, name the engine"):
        GenerateParams.model_validate(_form(engine=None))
    form = _form(engine=None)
    for spec in form["nodes"]:
        spec["engine"] = {"engine": "vllm", "model": "/models/qwen"}
    assert GenerateParams.model_validate(form).engine is None  # each node names it: enough
    twice = _form()
    twice["nodes"][1]["provision"] = {"node_name": "gpu-a", "inventory": "nodes.yaml"}
    with pytest.raises(ValueError, match="nodes lists \\['gpu-a'\\] more than once"):
        GenerateParams.model_validate(twice)
    no_worker = _form()
    no_worker["nodes"][0]["provision"]["start_worker"] = False
    with pytest.raises(ValueError, match="needs its worker"):
        GenerateParams.model_validate(no_worker)


def test_every_node_must_answer_alike():
    from dflash_core.serving.profiles import SglangProfile, VllmProfile
    from flows.generate_nodes import _same_work

    same = {"a": VllmProfile(model="/m", tensor_parallel_size=2), "b": VllmProfile(model="/m")}
    assert _same_work(same) == ("vllm", "/m")  # how each node runs it may differ
    named = {"a": VllmProfile(model="/a/m", served_model_name="qwen"), "b": VllmProfile(model="/b/m",
                                                                                      served_model_name="qwen")}
    assert _same_work(named) == ("vllm", "qwen")
    with pytest.raises(ValueError, match="would not answer alike.*'b': \\('sglang', '/m'\\)"):
        _same_work({"a": VllmProfile(model="/m"), "b": SglangProfile(model="/m")})
    with pytest.raises(ValueError, match="served_model_name"):
        _same_work({"a": VllmProfile(model="/a/m"), "b": VllmProfile(model="/b/m")})


def test_a_node_share_gets_its_own_settings_and_shards():
    from dflash_core.stage_results import ProvisionedNode
    from flows.generate import GenerateParams
    from flows.generate_nodes import _share_params

    params = GenerateParams.model_validate(_form(prompt_sources=[{"path": "p.jsonl", "name": "mine"}]))
    node = ProvisionedNode(node={"name": "gpu-a", "backend": "local", "work_dir": "/tmp/a"}, work_dir="/tmp/a",
                           venv="/tmp/a/venv", work_queue="node-gpu-a")
    share = _share_params(params, params.nodes[0], node, ["k1", "k2"], params.engine)
    assert share.nodes == [] and share.prompt_sources == [] and share.prompt_shards == ["k1", "k2"]
    assert (share.num_instances, share.devices, share.base_port) == (4, ["0", "1", "2", "3"], 8100)
    assert share.node.name == "gpu-a" and share.engine == params.engine
    assert (share.dataset, share.run, share.sampling) == (params.dataset, params.run, params.sampling)


def test_the_pipeline_runs_a_generation_across_nodes_where_it_runs():
    from dflash_core.stage_results import ProvisionedNode
    from flows.generate import GenerateParams
    from flows.node_stages import on_node, queue_of

    params = GenerateParams.model_validate(_form())
    node = ProvisionedNode(node={"name": "head", "backend": "local", "work_dir": "/tmp/h"}, work_dir="/tmp/h",
                           venv="/tmp/h/venv", work_queue="node-head", model="/placed")
    assert queue_of("generation", node, params) is None  # it sends each share to that node's own queue
    assert on_node("generation", params, node) is params
