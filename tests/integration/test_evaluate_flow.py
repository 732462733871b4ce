"""The evaluate flow end to end on the real Prefect and S3 servers: a drafter checkpoint in S3 (as
training uploads it) and held-out prompts -> report JSON + PNG whose manifests point at the
checkpoint it measured and the prompts, and Prefect artifacts.

Run: .venv/bin/python -m pytest tests/integration/test_evaluate_flow.py -q
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch

from dflash_core.lineage import read_manifest
from dflash_core.model.build import build_drafter


def _checkpoint_in_s3(store, prefix, tmp_path, *, variant="dflash"):
    from dflash_core.model import DFlashConfig
    from dflash_core.model.dflash2 import drafter_config
    from dflash_core.train.checkpoint import save_checkpoint
    from dflash_core.train.inputs import load_target_model
    from dflash_core.train.remote import upload_checkpoint

    target = load_target_model("tiny:qwen3", device=torch.device("cpu"), models_dir=tmp_path, seed=3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = DFlashConfig.from_target(target.config, num_layers=1, block_size=4, num_tapped_layers=2)
    config = drafter_config(variant, config, **({"selector_rank": 8} if variant == "dflash2" else {}))
    drafter = build_drafter(config)  # evaluation reads the architecture only
    path = save_checkpoint(tmp_path / "ckpt", step=7, model_state=drafter.state_dict(), train_state={},
                           meta={"drafter_config": config.to_dict()}, keep_last=1)
    upload_checkpoint(store, path, key_prefix=f"{prefix}/checkpoints", inputs=[], config={})
    return f"{prefix}/checkpoints/step-000007", target.config.vocab_size


@pytest.mark.parametrize("variant", ["dflash", "dflash2"])
def test_evaluate_flow_reports_with_lineage(prefect_server, store, env_settings, prefix, tmp_path, variant) -> None:
    """A DFlash 2 checkpoint evaluates in block mode on its selector path; the default modes' DDTree,
    DFlash-only, is skipped with a warning."""
    from flows.evaluate import EvaluateParams, evaluate

    checkpoint_key, vocab = _checkpoint_in_s3(store, prefix, tmp_path, variant=variant)
    generator = torch.Generator().manual_seed(0)
    lines = [json.dumps({"input_ids": torch.randint(1, vocab, (n,), generator=generator).tolist()}) for n in (5, 9, 6)]
    store.put_bytes(f"{prefix}/prompts.jsonl", ("\n".join(lines) + "\n").encode())
    params = EvaluateParams(checkpoint=checkpoint_key, prompts=f"{prefix}/prompts.jsonl", target="tiny:qwen3",
                            target_seed=3, run=tmp_path.name, num_prompts=2, max_new_tokens=12, tree_budget=6)

    state = evaluate(params, return_state=True)
    assert state.is_completed(), state
    summary = state.result()
    assert summary.split == "file" and summary.prompts == [store.uri(f"{prefix}/prompts.jsonl")]
    assert [s["mode"] for s in summary.summaries] == (["block", "tree"] if variant == "dflash" else ["block"])
    for s in summary.summaries:
        assert s["num_responses"] == 2 and s["all_match_target"] and s["tau"] >= 1.0 and s["new_tokens"] == 24

    report_key = summary.report.split("/", 3)[3]
    report = json.loads(store.get_bytes(report_key))
    assert len(report["summaries"][0]["acceptance_per_position"]) == 3
    assert sum(report["summaries"][0]["tau_histogram"].values()) == report["summaries"][0]["num_rounds"]
    manifest = read_manifest(store, report_key)
    assert manifest.kind == "report"
    uris = {i.uri for i in manifest.inputs}
    assert store.uri(f"{checkpoint_key}/model.safetensors") in uris
    assert store.uri(f"{checkpoint_key}/meta.json") in uris
    assert store.uri(f"{prefix}/prompts.jsonl") in uris
    assert all(i.sha256 for i in manifest.inputs)
    png_key = report["plot_uri"].split("/", 3)[3]
    assert store.get_bytes(png_key)[:8] == b"\x89PNG\r\n\x1a\n"
    # Keyed by flow run (a retry never overwrites a failed attempt's evidence); the result lists the
    # records of what the flow stored, and the flow's version is the git SHA.
    assert report_key.endswith(f"/{state.state_details.flow_run_id}/attempt-1/report.json")
    records = {r["uri"]: r for r in summary.artifacts}
    assert set(records) == {summary.report, report["plot_uri"], summary.result_uri}
    assert records[summary.report] == {"uri": summary.report, "kind": "report", "sha256": manifest.sha256,
                                       "manifest": summary.report + ".manifest.json"}
    assert report["measured_on"] == "a prompt file given by the user"
    assert evaluate.version == manifest.producer.git_sha


def test_evaluate_flow_rejects_a_missing_checkpoint(prefect_server, store, env_settings, prefix, tmp_path) -> None:
    from flows.evaluate import EvaluateParams, evaluate

    store.put_bytes(f"{prefix}/prompts.jsonl", b'{"input_ids": [1, 2, 3]}\n')
    params = EvaluateParams(checkpoint=f"{prefix}/nothing-here", prompts=f"{prefix}/prompts.jsonl",
                            target="tiny:qwen3", run=tmp_path.name)
    state = evaluate(params, return_state=True)
    assert state.is_failed()
    with pytest.raises(ValueError, match="neither a local dir nor an S3 checkpoint"):
        state.result()
