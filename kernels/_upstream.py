"""Checks that the installed jax still provides what an adapter wraps.

Upstream Pallas kernels live under `jax.experimental` and move between releases; an adapter
probes once at construction and reports itself unavailable with the reason instead of failing
at call time.
"""

from __future__ import annotations

import importlib
import inspect
from types import ModuleType


def probe(module: str, function: str, params: tuple[str, ...],
          attrs: tuple[str, ...] = ()) -> tuple[ModuleType | None, str | None]:
    """(module, None) if `module.function` exists and accepts `params` and the module has
    `attrs`; otherwise (None, reason)."""
    try:
        mod = importlib.import_module(module)
    except Exception as e:  # noqa: BLE001 - any import failure means "not usable"
        return None, f"cannot import {module} ({type(e).__name__}: {e})"
    fn = getattr(mod, function, None)
    if fn is None:
        return None, f"{module} has no {function}"
    missing = [a for a in attrs if not hasattr(mod, a)]
    if missing:
        return None, f"{module} lacks {', '.join(missing)}"
    try:
        accepted = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return None, f"cannot read the signature of {module}.{function}"
    absent = [p for p in params if p not in accepted]
    if absent:
        return None, f"{module}.{function} takes no {', '.join(absent)}"
    return mod, None
