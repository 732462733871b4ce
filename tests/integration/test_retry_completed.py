"""What the Prefect UI's Retry button does to a Completed run, on the real Prefect server: the UI Prefect
serves by default asks the server to set the run to AwaitingRetry without forcing it; the server refuses
(our runs persist their results), the run stays Completed and nothing runs again. The deployment descriptions, the run summary and docs/operations.md
say so and say how to rerun a finished stage instead; this test keeps them true.

Run: `.venv/bin/python -m pytest -n 0 -q tests/integration/test_retry_completed.py`
"""

from __future__ import annotations

import httpx

from flows.deployment_table import DEPLOYMENTS


def test_retry_on_a_completed_run_is_refused_by_the_server_as_the_descriptions_say(prefect_server, settings,
                                                                                   tmp_path, monkeypatch):
    from prefect import flow
    from prefect.client.orchestration import get_client

    @flow(name="dflash-retry-probe", persist_result=True)  # as every stage's run persists its result
    def probe() -> int:
        return 1

    monkeypatch.setenv("PREFECT_LOCAL_STORAGE_PATH", str(tmp_path / "results"))
    state = probe(return_state=True)
    assert state.is_completed()
    flow_run_id = state.state_details.flow_run_id
    # The request the default UI's Retry sends (its bundled retryFlowRun: setFlowRunState(id, AwaitingRetry, force
    # false)). The experimental UI v2 forces the move, which the server accepts: that run goes again in place.
    body = {"state": {"type": "SCHEDULED", "name": "AwaitingRetry", "message": "Retry from the UI"}, "force": False}
    answer = httpx.post(f"{settings.prefect_api_url}/flow_runs/{flow_run_id}/set_state", json=body, timeout=30)
    answer.raise_for_status()  # the HTTP call succeeds: the UI shows its success toast
    result = answer.json()
    assert result["status"] == "REJECT", result
    assert "already COMPLETED" in (result["details"].get("reason") or ""), result
    with get_client(sync_client=True) as client:
        run = client.read_flow_run(flow_run_id)
    assert run.state.is_completed() and run.run_count == 1
    for spec in DEPLOYMENTS:
        assert "Run is already COMPLETED" in spec.description, spec.name
