"""The README's layout table is what the imports do: each module imports only its own layer
and the layers below it, and `jax._src` only through the one seam."""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
# Source folder -> installed package (pyproject's package-dir).
PACKAGES = {"hlotool": "hlotool", "kernels": "hlotool.kernels", "passes": "hlotool.passes"}

# Lowest first; a module may import from its own layer and any layer above it in this list.
LAYERS = [
    ("contracts", ("hlotool.errors", "hlotool.site", "hlotool.source", "hlotool.units",
                   "hlotool.hardware", "hlotool.targets", "hlotool.jaxcompat")),
    ("capture and IR", ("hlotool.capture", "hlotool.hlo")),
    ("kernels", ("hlotool.kernels",)),
    ("passes", ("hlotool.passes",)),
    ("cost", ("hlotool.cost",)),
    ("flash_jit", ("hlotool.flash", "hlotool.validate", "hlotool.site_report", "hlotool.api")),
    ("reports and CLI", ("hlotool.report", "hlotool.cli", "hlotool.__main__", "hlotool.doctor",
                         "hlotool")),  # the package itself: the public API, a façade
]


def _layer(module: str) -> int:
    best, depth = None, -1
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > depth:
                best, depth = i, len(p)
    if best is None:
        raise AssertionError(f"{module} is in no layer of tests/test_layering.py")
    return best


def _modules():
    for folder, package in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT / folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            yield ".".join([package, *parts]), path


def _imports(path: pathlib.Path) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.extend((node.lineno, f"{node.module}.{a.name}") for a in node.names)
        elif isinstance(node, ast.Import):
            found.extend((node.lineno, a.name) for a in node.names)
    return found


MODULES = list(_modules())


@pytest.mark.parametrize("module,path", MODULES, ids=[m for m, _ in MODULES])
def test_imports_point_down_the_layers(module, path):
    own = _layer(module)
    upward = []
    for line, name in _imports(path):
        if not name.startswith("hlotool"):
            continue
        # `from hlotool import kernels` names a module, `from hlotool.site import
        # AttentionSite` an object in one: the longest prefix in a layer decides.
        theirs = _layer(name)
        if theirs > own:
            upward.append(f"line {line}: {name} ({LAYERS[theirs][0]})")
    assert not upward, f"{module} ({LAYERS[own][0]}) imports upwards: {upward}"
