"""What the Prefect UI shows of each deployment survives it and tells the truth: the UI renders descriptions
as markdown with HTML, so angle-bracketed text outside backticks (`</think>`, `<work_dir>`) vanishes from
every form description of every deployment's parameter schema (built as flows/deployments.py `_register`
builds it) and from the deployment's own description; each stage's description says how to rerun a
finished run (the UI's Retry is refused on a Completed run), and each schedule's time says UTC.

Run: `.venv/bin/python -m pytest -n 0 -q tests/unit/test_form_descriptions.py`
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest

from flows.deployment_table import DEPLOYMENTS, DeploymentSpec

_IN_BACKTICKS = re.compile(r"`[^`]*`")
_TAG_LIKE = re.compile(r"<[A-Za-z/!][^<>]*>")  # what an HTML sanitizer takes for a tag and drops


def tags_outside_backticks(text: str) -> list[str]:
    return _TAG_LIKE.findall(_IN_BACKTICKS.sub("", text))


def descriptions(schema: Any, path: str = "") -> Iterator[tuple[str, str]]:
    """(where, text) of every description in a JSON schema, nested definitions included."""
    if isinstance(schema, dict):
        for key, value in schema.items():
            if key == "description" and isinstance(value, str):
                yield path or "/", value
            else:
                yield from descriptions(value, f"{path}/{key}")
    elif isinstance(schema, list):
        for index, item in enumerate(schema):
            yield from descriptions(item, f"{path}/{index}")


def _schema(spec: DeploymentSpec) -> dict:
    from prefect.utilities.callables import parameter_schema

    from flows.deployments import _load_flow

    return parameter_schema(_load_flow(spec.entrypoint)).model_dump(exclude_unset=True)


def test_the_check_sees_tags_and_leaves_backticks_and_comparisons_alone():
    assert tags_outside_backticks("loss starts after </think>") == ["</think>"]
    assert tags_outside_backticks("default <work_dir>/venv") == ["<work_dir>"]
    assert tags_outside_backticks("loss starts after `</think>`; default `<work_dir>/venv`") == []
    assert tags_outside_backticks("a < b and c > d, x <= 1") == []
    assert list(descriptions({"description": "a", "definitions": {"X": {"properties": {
        "f": {"description": "b"}}}}})) == [("/", "a"), ("/definitions/X/properties/f", "b")]


@pytest.mark.parametrize("spec", DEPLOYMENTS, ids=lambda spec: spec.name)
def test_no_description_of_a_deployments_form_loses_angle_bracketed_text(spec):
    found = [(where, tags_outside_backticks(text)) for where, text in descriptions(_schema(spec))]
    found.append(("the deployment's description", tags_outside_backticks(spec.description)))
    lost = [(where, tags) for where, tags in found if tags]
    assert not lost, f"{spec.name}: the UI drops these (put them in backticks): {lost}"


def test_each_stage_says_how_to_rerun_a_finished_run_and_that_retry_is_refused():
    for spec in DEPLOYMENTS:
        text = spec.description
        assert "Retry" in text and "Completed" in text and "refuses" in text, spec.name
        assert "Prefect has no Retry" not in text and "offers no Retry" not in text, spec.name
        if spec.module in ("generate", "tokenize", "pipeline"):
            assert "refresh=true" in text, spec.name


def test_schedules_say_their_time_in_utc():
    for spec in DEPLOYMENTS:
        if spec.schedule is not None:
            minute, hour = spec.schedule.cron_utc.split()[:2]
            assert f"{int(hour):02d}:{int(minute):02d} UTC" in spec.description, spec.name
