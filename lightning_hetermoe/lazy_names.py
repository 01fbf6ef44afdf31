"""A package's public names imported on first read (PEP 562): what ``import`` of the package
costs is then what the caller uses, not every module behind its ``__all__`` (the planning side
never loads Lightning or torch)."""

from __future__ import annotations

import sys
from importlib import import_module
from typing import Any, Callable


def lazy_names(package: str, home: dict[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The ``__getattr__`` and ``__dir__`` of ``package`` (its ``__name__``), whose public
    names map to the modules that define them (relative to it) in ``home``."""

    def __getattr__(name: str) -> Any:
        if name not in home:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(import_module(home[name], package), name)
        vars(sys.modules[package])[name] = value  # read once: the module's own attribute from then on
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(home))

    return __getattr__, __dir__
