"""`StrictModel`: the base of every model a user writes (run.yaml, `--set`, flow parameters, the pipeline
file). An unknown key is an error that names it and the nearest valid field, so a typo fails instead of
training silently on a default (`max_step: 5` -> "max_step: unknown field of TrainConfig; did you mean
'max_steps'?").

Records a stage or a run wrote (dflash_core/stage_results.py, manifests) stay lenient: an older record
with a field since removed must still read.
"""

from __future__ import annotations

import difflib
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError, model_validator
from pydantic_core import PydanticCustomError, PydanticKnownError

_UNKNOWN = "extra_forbidden"  # pydantic's type for a key no field takes; kept, only its message changes


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="wrap")
    @classmethod
    def _name_unknown_keys(cls, data: Any, handler) -> Any:
        try:
            return handler(data)
        except ValidationError as error:
            problems = error.errors(include_url=False)
            if not any(_own_unknown_key(p) for p in problems):
                raise
            raise ValidationError.from_exception_data(
                error.title, [_restated(cls, problem) for problem in problems]) from None


def _own_unknown_key(problem: dict) -> bool:
    """An unknown key of the model being validated: at depth 1, not yet named (a nested model's validator
    names its own, and gives them a hint)."""
    return problem["type"] == _UNKNOWN and len(problem["loc"]) == 1 and "hint" not in problem.get("ctx", {})


def _restated(model: type[BaseModel], problem: dict) -> dict:
    """`problem` as pydantic reports it again; an unknown key of `model` with its nearest valid field."""
    loc, value, ctx = problem["loc"], problem["input"], problem.get("ctx")
    if _own_unknown_key(problem):
        fields = list(model.model_fields)
        near = difflib.get_close_matches(str(loc[0]), fields, n=1)
        ctx = {"model": model.__name__,
               "hint": f"did you mean {near[0]!r}?" if near else f"its fields are {', '.join(fields)}"}
    if problem["type"] == _UNKNOWN and ctx and "hint" in ctx:
        return {"type": PydanticCustomError(_UNKNOWN, "unknown field of {model}; {hint}", ctx), "loc": loc,
                "input": value}
    try:  # a known error type states its message from its context again
        known = PydanticKnownError(problem["type"], ctx).message() == problem["msg"]
    except (KeyError, TypeError):  # a custom error type, raised by a validator: its message as it was
        known = False
    if known:
        return {"type": problem["type"], "loc": loc, "input": value, **({"ctx": ctx} if ctx else {})}
    return {"type": PydanticCustomError(problem["type"], problem["msg"]), "loc": loc, "input": value}


def not_utf8_text(error: UnicodeDecodeError) -> str:
    """What to say of a file a user wrote that is not UTF-8 (saved as Latin-1 or UTF-16, say): after its name."""
    return (f"not UTF-8 text (byte 0x{error.object[error.start]:02x} at offset {error.start}); save it as UTF-8 "
            f"and try again")


def validation_summary(error: ValidationError) -> str:
    """Every problem of `error` on one line: `drafter.num_layer: unknown field of DrafterSettings; did you
    mean 'num_layers'?; optim.lr: Input should be greater than 0`."""
    parts = []
    for problem in error.errors(include_url=False):
        where = ".".join(str(part) for part in problem["loc"])
        message = problem["msg"].removeprefix("Value error, ")
        parts.append(f"{where}: {message}" if where else message)
    return "; ".join(parts)
