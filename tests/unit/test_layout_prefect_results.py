"""The S3 audit's idea of where Prefect's results live (dflash_core.layout) is where the result block
puts them (dflash_core.services.stages, used by flows/results.py)."""

from __future__ import annotations

from dflash_core.layout import PREFECT_RESULTS_FOLDER
from dflash_core.services.stages import RESULTS_FOLDER


def test_the_audit_knows_the_folder_prefect_results_are_written_to() -> None:
    assert PREFECT_RESULTS_FOLDER == RESULTS_FOLDER
