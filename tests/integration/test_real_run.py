"""A whole real run from one form, on a CPU: the `pipeline` flow over the suite's SSH test node (a real
OpenSSH server on loopback) with a real `transformers serve` and a tiny real model: provision ->
generate -> tokenize -> train -> evaluate (held-out split) -> export -> preserve -> S3 audit, each
stage's input the previous stage's result.

The target is a tiny random 4-layer Llama with the SmolLM2 tokenizer (tests/tiny_models.py): the same
code path as SmolLM2 or Qwen3.6-27B, minutes faster. Skips where sshd is missing (tests/sshd_fixture.py).

The run is `whole_run` (tests/integration/shared_runs.py), made once per session: test_dag.py checks what
it trained on, evaluated and recorded. Run: `.venv/bin/python -m pytest -q tests/integration/test_real_run.py`
"""

from __future__ import annotations

import pytest


def test_one_form_runs_the_whole_dag_over_an_ssh_node(whole_run, store, settings):
    if whole_run.node is None:
        pytest.skip("SSH backend tests SKIPPED: /usr/sbin/sshd is missing (tests/sshd_fixture.py says how to "
                    "install it); the shared run ran without a node")
    state, result, name = whole_run.state, whole_run.result, whole_run.name
    assert state.is_completed(), state

    assert result.provision.node["name"] == name and result.provision.actions
    generation, tokenized, checkpoint = result.generation, result.tokenization, result.training
    assert generation.outcomes["completed"] == 12 and len(generation.heldout_prompt_ids) == 2
    assert tokenized.completions == generation.result_uri  # each stage took the result before it
    assert checkpoint.dataset.result_uri == tokenized.result_uri
    assert [s.sha256 for s in checkpoint.data] == [s.sha256 for s in tokenized.train_shards]
    assert result.evaluation.checkpoint == checkpoint.uri and result.evaluation.split == "heldout"
    assert result.evaluation.prompts == [s.uri for s in tokenized.heldout_shards]
    assert result.export.checkpoint == checkpoint.uri
    assert result.preserve["prefix"].startswith(store.uri(f"node-backups/{name}/"))
    assert result.audit["objects"] > 0
    stored = {record["uri"] for record in result.artifacts}
    assert generation.result_uri in stored and result.evaluation.report in stored and result.report in stored

    # The stage table `dflash run pipeline` prints (shown with -s), read back from the Prefect server.
    from rich.console import Console

    from dflash_core import run_summary

    stages = run_summary.read_stage_runs(settings.prefect_api_url, str(state.state_details.flow_run_id))
    assert [s.stage for s in stages] == ["pipeline", "provision", "generate", "tokenize", "train", "evaluate", "export",
                                         "preserve", "s3-audit"]
    assert all(s.state == "Completed" for s in stages)
    Console(width=200).print(run_summary.stage_table(result.model_dump(mode="json"), stages, title="real run (CPU)"))
