"""A package's names loaded on first use (PEP 562), so importing one of its torch-free submodules does not
import the torch-bound ones."""

from __future__ import annotations

from collections.abc import Callable
from importlib import import_module
from typing import Any


def lazy_getattr(package: str, homes: dict[str, str]) -> Callable[[str], Any]:
    """The module `__getattr__` of `package`: name -> getattr(package.homes[name], name), imported then."""

    def __getattr__(name: str) -> Any:
        if name not in homes:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(import_module(f"{package}.{homes[name]}"), name)

    return __getattr__
