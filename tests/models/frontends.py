"""Run detection on one function through either front end, the way `inspect` and the rewrite do."""

from __future__ import annotations

import inspect
from typing import Any, Callable

import jax

from hlotool.hlo import parse_module
from hlotool.passes.from_hlo import detect_hlo
from hlotool.passes.from_jaxpr import detect_jaxpr
from hlotool.site import AttentionSite

FRONTENDS = ("jaxpr", "hlo")


def detect(fn: Callable, args: tuple[Any, ...], frontend: str) -> list[AttentionSite]:
    """Sites of `fn(*args)`: jaxpr via make_jaxpr, HLO via pre-optimization text, calls inlined."""
    if frontend == "jaxpr":
        return [s.site for s in detect_jaxpr(jax.make_jaxpr(fn)(*args), "fn")]
    text = jax.jit(fn).lower(*args).as_text(dialect="hlo", debug_info=True)
    return detect_hlo(parse_module(text).inline_calls(), "fn")


def tagged_line(fn: Callable, tag: str = "# QK") -> str:
    """'file:line' of the line in `fn`'s source carrying `tag`."""
    lines, start = inspect.getsourcelines(fn)
    for offset, line in enumerate(lines):
        if tag in line:
            return f"{inspect.getsourcefile(fn)}:{start + offset}"
    raise AssertionError(f"{fn.__name__} has no line tagged {tag!r}")
