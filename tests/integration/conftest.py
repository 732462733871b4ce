"""What several integration modules read, made once per session: the stage server, and two pipeline runs
that tests of different modules check different things about (tests/integration/shared_runs.py):
`whole_run`, the whole DAG from one form, and `retried_pipeline`, a pipeline deployment run whose failed
stage was retried alone and which was then retried to completion.
"""

from __future__ import annotations

import pytest

from tests.integration import shared_runs


@pytest.fixture(scope="session")
def stage_server(settings, s3_server, prefect_server, early):
    from dflash_core.services import local
    from dflash_core.services.stages import stage_service

    def start_now():
        service = stage_service(settings)
        local.start(service)
        return service

    service = early.get("stage_server", start_now)
    yield service
    local.shutdown(service)


@pytest.fixture(scope="session")
def whole_run(prefect_server, store, settings, tiny_target, tmp_path_factory, early):
    """The whole DAG from one form, over the SSH test node where sshd is installed (else on this host,
    without the provision and preserve stages); started early (tests/early.py)."""
    import os

    return early.get("whole_run", shared_runs.run_whole_dag_in_a_process, settings, tiny_target,
                     tmp_path_factory.mktemp("whole-run"), tmp_path_factory.mktemp("sshd"), dict(os.environ))


@pytest.fixture(scope="session")
def retried_pipeline(stage_server, store, settings, tiny_target, tmp_path_factory, early):
    """A pipeline deployment run (tokenize -> train) that failed at its first stage, had that stage
    retried alone after the fix, and was then retried to completion; started early (tests/early.py)."""
    run = early.get("retried_pipeline", shared_runs.retry_a_failed_pipeline_here, store, settings, tiny_target,
                    tmp_path_factory.mktemp("retried"))
    # The settings are exported while its result is read only: later tests must not see them.
    with pytest.MonkeyPatch.context() as patch:
        shared_runs.export_settings(patch, settings, result_store=True)
        return shared_runs.with_result(run)
