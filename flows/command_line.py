"""`python -m flows.<name> [which] --params '<json>'`: the one way every flow runs from a shell."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable

from pydantic import BaseModel


def run_from_command_line(flow: Callable, params_model: type[BaseModel]) -> None:
    parser = argparse.ArgumentParser(description=f"Run the {getattr(flow, 'name', flow.__name__)} flow.")
    parser.add_argument("--params", default="{}", help=f"{params_model.__name__} as JSON")
    args = parser.parse_args()
    print(json.dumps(flow(params_model.model_validate_json(args.params)), indent=2, default=str))


def run_chosen_from_command_line(flows: dict[str, tuple[Callable, type[BaseModel]]]) -> None:
    """For a module holding several flows: the first argument names which (`python -m flows.s3 audit`)."""
    parser = argparse.ArgumentParser(description=f"Run one of the {', '.join(flows)} flows.")
    parser.add_argument("which", choices=list(flows))
    parser.add_argument("--params", default="{}", help=" / ".join(f"{m.__name__}" for _, m in flows.values())
                        + " as JSON")
    args = parser.parse_args()
    flow, params_model = flows[args.which]
    print(json.dumps(flow(params_model.model_validate_json(args.params)), indent=2, default=str))
