"""The RPC routes, one module per resource, each listing its ``ROUTES``; agent/rpc/app.py serves
every module found here (``route_modules``), so a new resource is one new module
(docs/openapi.yaml is their contract)."""

from __future__ import annotations

import importlib
import pkgutil
from types import ModuleType


def route_modules() -> list[ModuleType]:
    """Every module of this package, by name."""
    names = sorted(m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_"))
    return [importlib.import_module(f"{__name__}.{name}") for name in names]
