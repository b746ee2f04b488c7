"""Public names imported on first use: a module ``__getattr__`` (PEP 562) built from a table, so
that importing a package costs nothing until one of its names is asked for (``hp-dcp-hf inspect``
reads headers without importing DCP or transformers' modeling stack)."""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(package: str, namespace: dict[str, Any], exports: Mapping[str, str], *,
                 submodules: bool = False) -> Callable[[str], Any]:
    """The ``__getattr__`` of module ``package`` (whose ``globals()`` is ``namespace``): each name of
    ``exports`` (name -> the module defining it) is imported when first asked for and kept in the
    namespace, so later lookups skip the hook. With ``submodules``, other public names resolve to
    the package's submodules (``hp_dcp_hf.integrations.transformers`` after a bare ``import hp_dcp_hf``)."""

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is not None:
            value = namespace[name] = getattr(importlib.import_module(module), name)
            return value
        if submodules and not name.startswith("_") and importlib.util.find_spec(f"{package}.{name}") is not None:
            return importlib.import_module(f"{package}.{name}")
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
