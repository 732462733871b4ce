"""`python -m flows.<name> [which] --params '<json>'`: the one way every flow runs from a shell."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable

from pydantic import BaseModel
from pydantic_core import to_jsonable_python


def run_from_command_line(flow: Callable, params_model: type[BaseModel]) -> None:
    parser = argparse.ArgumentParser(description=f"Run the {getattr(flow, 'name', flow.__name__)} flow.")
    parser.add_argument("--params", default="{}", help=f"{params_model.__name__} as JSON")
    args = parser.parse_args()
    print(result_json(flow(params_model.model_validate_json(args.params))))


def result_json(result) -> str:
    """A flow's result (a typed stage record, a dict) as indented JSON."""
    return json.dumps(to_jsonable_python(result, fallback=str), indent=2)


def run_chosen_from_command_line(flows: dict[str, tuple[Callable, type[BaseModel]]]) -> None:
    """For a module holding several flows: the first argument names which (`python -m flows.s3 audit`)."""
    parser = argparse.ArgumentParser(description=f"Run one of the {', '.join(flows)} flows.")
    parser.add_argument("which", choices=list(flows))
    parser.add_argument("--params", default="{}", help=" / ".join(f"{m.__name__}" for _, m in flows.values())
                        + " as JSON")
    args = parser.parse_args()
    flow, params_model = flows[args.which]
    print(result_json(flow(params_model.model_validate_json(args.params))))
