"""Every choice in a deployment's form can be chosen in the Prefect UI: the form draws one button per option of an
`anyOf` (or `oneOf`), labelled by the option's title, format or type (a `$ref` by its definition's), so an option
without any of these (a discriminated union inside `X | None`: an `anyOf` whose first option is a bare `oneOf`) is a
blank button that leads nowhere. The generate form's engine is one button per engine beside None, and the server's
own schema check accepts the same JSON as before.

Run: `.venv/bin/python -m pytest -n 0 -q tests/unit/test_form_choices.py`
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from flows.deployment_table import DEPLOYMENTS, DeploymentSpec

_TYPE_LABELS = {"null": "None", "string": "str", "boolean": "bool", "integer": "int", "number": "float",
                "array": "list", "object": "dict"}  # Prefect UI's labels of a type


def _schema(spec: DeploymentSpec) -> dict:
    from prefect.utilities.callables import parameter_schema

    from flows.deployments import _load_flow

    return parameter_schema(_load_flow(spec.entrypoint)).model_dump(exclude_unset=True)


def choice_label(option: dict, definitions: dict) -> str:
    """What the UI writes on an option's button: its title, else its format, else its type's name."""
    if "$ref" in option:
        option = {**definitions[option["$ref"].rsplit("/", 1)[-1]], **{k: v for k, v in option.items() if k != "$ref"}}
    return option.get("title") or option.get("format") or _TYPE_LABELS.get(option.get("type"), "")


def choices(schema: Any, path: str = "") -> Iterator[tuple[str, list[dict]]]:
    """(where, options) of every anyOf / oneOf in a JSON schema, nested definitions included."""
    if isinstance(schema, dict):
        for key, value in schema.items():
            if key in ("anyOf", "oneOf") and isinstance(value, list):
                yield f"{path}/{key}", value
            yield from choices(value, f"{path}/{key}")
    elif isinstance(schema, list):
        for index, item in enumerate(schema):
            yield from choices(item, f"{path}/{index}")


@pytest.mark.parametrize("spec", DEPLOYMENTS, ids=lambda spec: spec.name)
def test_every_option_of_every_choice_in_a_form_has_a_label(spec):
    schema = _schema(spec)
    blank = [(where, index) for where, options in choices(schema) for index, option in enumerate(options)
             if not choice_label(option, schema.get("definitions", {}))]
    assert not blank, f"{spec.name}: the UI draws these options as blank buttons: {blank}"


def _generate_schema() -> dict:
    return _schema(next(spec for spec in DEPLOYMENTS if spec.name == "generate"))


def test_the_generate_forms_engine_is_one_button_per_engine_beside_none():
    schema = _generate_schema()
    definitions = schema["definitions"]
    for model, field in (("GenerateParams", "engine"), ("GenerationNode", "engine")):
        options = definitions[model]["properties"][field]["anyOf"]
        assert [choice_label(option, definitions) for option in options] == [
            "None", "VllmProfile", "SglangProfile", "TransformersProfile"], model


@pytest.mark.parametrize("engine", [None, {"engine": "vllm", "model": "m"}, {"engine": "sglang", "model": "m"},
                                    {"engine": "transformers", "model": "m", "dtype": "float32"}],
                         ids=["none", "vllm", "sglang", "transformers"])
def test_the_server_and_the_flow_accept_the_same_engine_json_as_before(engine):
    from prefect.utilities.schema_tools import validate

    from flows.generate_params import GenerateParams

    params = {"dataset": "d", "run": "r", "engine": engine}
    validate({"params": params}, _generate_schema(), raise_on_error=True)
    assert GenerateParams.model_validate(params).model_dump(exclude_unset=True)["engine"] == engine


def test_the_server_still_refuses_an_unknown_engine():
    from prefect.utilities.schema_tools import ValidationError, validate

    with pytest.raises(ValidationError):
        validate({"params": {"dataset": "d", "run": "r", "engine": {"engine": "tgi", "model": "m"}}},
                 _generate_schema(), raise_on_error=True)
