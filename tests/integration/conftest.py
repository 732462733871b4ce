"""What several integration modules read, made once per session: the stage server, and two pipeline runs
that tests of different modules check different things about (tests/integration/shared_runs.py):
`whole_run`, the whole DAG from one form, and `retried_pipeline`, a pipeline deployment run whose failed
stage was retried alone and which was then retried to completion.
"""

from __future__ import annotations

import pytest

from tests.integration import shared_runs
from tests.sshd_fixture import SSHD, start_sshd


@pytest.fixture(scope="session")
def stage_server(settings, s3_server, prefect_server):
    from dflash_core.services import local
    from dflash_core.services.stages import stage_service

    service = stage_service(settings)
    local.start(service)
    yield service
    local.shutdown(service)


@pytest.fixture(scope="session")
def whole_run(prefect_server, store, settings, tiny_target, tmp_path_factory):
    """The whole DAG from one form, over the SSH test node where sshd is installed (else on this host,
    without the provision and preserve stages)."""
    home = tmp_path_factory.mktemp("whole-run")
    sshd = start_sshd(tmp_path_factory.mktemp("sshd")) if SSHD.exists() else None
    # The settings are exported while the run runs only: later tests must not see them.
    with pytest.MonkeyPatch.context() as patch:
        shared_runs.export_settings(patch, settings)
        try:
            run = shared_runs.run_whole_dag(store, settings, tiny_target, home,
                                            sshd=next(sshd) if sshd is not None else None)
        finally:
            if sshd is not None:
                sshd.close()
    return run


@pytest.fixture(scope="session")
def retried_pipeline(stage_server, store, settings, tiny_target, tmp_path_factory):
    """A pipeline deployment run (tokenize -> train) that failed at its first stage, had that stage
    retried alone after the fix, and was then retried to completion."""
    with pytest.MonkeyPatch.context() as patch:
        shared_runs.export_settings(patch, settings, result_store=True)
        return shared_runs.retry_a_failed_pipeline(store, settings, tiny_target, tmp_path_factory.mktemp("retried"))
