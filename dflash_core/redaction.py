"""Secrets out of everything we store or show: configs, manifests, recorded command lines."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel, SecretStr

REDACTED = "**********"
_SECRET_SUBSTRINGS = ("secret", "password", "credential")
_SECRET_SUFFIXES = ("token", "api_key", "apikey", "access_key", "access_key_id", "private_key", "auth")


def _looks_secret(name: object) -> bool:
    name = str(name).lower().replace("-", "_")
    return any(word in name for word in _SECRET_SUBSTRINGS) or name.endswith(_SECRET_SUFFIXES)


def redact(value: Any) -> Any:
    """Config made safe to store: SecretStr and secret-looking keys become '**********'."""
    if isinstance(value, SecretStr):
        return REDACTED
    if isinstance(value, BaseModel):
        return redact(value.model_dump(mode="python"))
    if isinstance(value, dict):
        return {
            k: REDACTED if _looks_secret(k) and v is not None else redact(v)
            for k, v in value.items()
        }
    if isinstance(value, (list, tuple)):
        return [redact(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    return value


SECRET_FLAGS = ("--api-key", "--token", "--password", "--secret")


def redact_argv(argv: list[str]) -> list[str]:
    """argv safe to record: values of secret flags masked; JSON arguments with secret-named keys masked."""
    safe: list[str] = []
    for index, arg in enumerate(argv):
        flag, _, value = arg.partition("=")
        if flag in SECRET_FLAGS and value:
            safe.append(f"{flag}={REDACTED}")
        elif index and argv[index - 1] in SECRET_FLAGS:
            safe.append(REDACTED)
        elif arg.lstrip().startswith("{"):
            try:
                safe.append(json.dumps(redact(json.loads(arg))))
            except ValueError:
                safe.append(arg)
        else:
            safe.append(arg)
    return safe
