"""`python -m flows.<name> --params '<json>'`: the one way every flow runs from a shell."""

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
