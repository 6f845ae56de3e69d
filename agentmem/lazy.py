"""Module attributes imported on first use (PEP 562), so light commands never import torch."""

from __future__ import annotations

from collections.abc import Callable
from importlib import import_module


def lazy_attributes(package: str, homes: dict[str, str]) -> Callable[[str], object]:
    """A module ``__getattr__`` that imports each name in ``homes`` (name → module) when first asked for."""

    def __getattr__(name: str) -> object:
        if name not in homes:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(import_module(homes[name]), name)

    return __getattr__
