import os
import sys
import types

import pytest

# Tests run on the host CPU; with libtpu installed jax would otherwise probe for a TPU.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Keras (tests/test_train_steps.py) reads its backend once, at its first import.
os.environ.setdefault("KERAS_BACKEND", "jax")
# Commands lay text out to $COLUMNS when it is set, and pytest-xdist's workers set it to 80;
# tests read unwrapped output, and those about a width set their own.
os.environ.pop("COLUMNS", None)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items):
    """`@pytest.mark.sweep(keep=N)` on a parametrized test: the README's suite runs its first N
    cases (in collection order), which cover the behaviour it checks; the rest are marked
    `slow` and run in CI's `-m slow` pass (`-m` reads the marks as this hook leaves them)."""
    seen: dict[tuple[str, str], int] = {}
    for item in items:
        sweep = item.get_closest_marker("sweep")
        if sweep is None or not hasattr(item, "callspec"):
            continue
        key = (item.nodeid.split("::")[0], item.originalname)
        seen[key] = seen.get(key, 0) + 1
        if seen[key] > sweep.kwargs["keep"]:
            item.add_marker(pytest.mark.slow)


@pytest.fixture(autouse=True, scope="session")
def pallas_tpu_preferred():
    """Where tokamax is installed the registry prefers it on TPU; the suite's TPU expectations
    (custom-call counts, cost estimates, reasons) are jax's own Pallas TPU kernels' (splash,
    flash). Session-wide,
    so module-scoped fixtures see it too; the tokamax tests put it back first
    (tests/test_jaxcompat.py)."""
    from hlotool.kernels import registry

    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(registry.PRIORITY, "tpu", tuple(
            name for name in registry.PRIORITY["tpu"] if name != "tokamax_tpu"))
        yield


@pytest.fixture
def fake_module(monkeypatch):
    """Registers a stand-in module under a name of its own, for the seam's probes to find
    (or not find) what a jax release has."""

    def make(name: str, **attrs):
        module = types.ModuleType(name)
        module.__dict__.update(attrs)
        monkeypatch.setitem(sys.modules, name, module)
        return module

    return make


@pytest.fixture
def tpu_compiler():
    """libtpu loaded for deviceless compiles, as hlotool's commands load it, so a decision
    asks XLA:TPU whether it fuses the site (without it, the answer is "unknown"): whether
    an earlier test in the worker loaded it must not decide the test."""
    from hlotool.targets import load_tpu_compiler, tpu_compiler_loaded

    load_tpu_compiler()
    assert tpu_compiler_loaded(), "libtpu (the test extra) is needed to compile for TPU"
