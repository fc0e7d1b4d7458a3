"""Checks that the installed jax (or tokamax) still provides what an adapter wraps.

Upstream kernels live under `jax.experimental` (or in tokamax) and move between releases; an
adapter probes once and reports itself unavailable with the reason instead of failing at call
time. A deprecation upstream announces at import is kept as a note (`hlotool doctor` shows
it) rather than shown to the user on every import of hlotool.kernels.
"""

from __future__ import annotations

import abc
import dataclasses
import importlib
import importlib.metadata
import warnings
from collections.abc import Callable
from types import ModuleType

import jax
import numpy as np

from hlotool import jaxcompat
from hlotool.hardware import Hardware, for_device_kind, get_hardware
from hlotool.jaxcompat import signature_problem
from hlotool.kernels.base import (
    AttentionKernel,
    Call,
    round_up,
    with_empty_rows,
    zero_invalid_keys,
)
from hlotool.kernels.chunked import Chunked

# TPU kernels tile lengths by lanes of 128.
LANES = 128
# The logit upstream kernels give the keys they hide (their DEFAULT_MASK_VALUE; cuDNN's is
# assumed no larger), in place of a call's `fill`: finite, so a fully masked row cannot
# produce inf - inf.
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)


@dataclasses.dataclass(frozen=True)
class Upstream:
    """What a probe found: the module (None when unusable), why not, and upstream's own
    deprecation notice, if it gave one."""

    module: ModuleType | None
    reason: str | None = None
    deprecated: str | None = None


def version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def probe(module: str, function: str, params: tuple[str, ...],
          attrs: tuple[str, ...] = (), distribution: str = "jax") -> Upstream:
    """`module` if `module.function` exists and accepts `params` and the module has `attrs`;
    otherwise the reason, naming the installed version of `distribution`."""
    where = f"{distribution} {version(distribution)}"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", DeprecationWarning)
        try:
            mod = importlib.import_module(module)
        except Exception as e:  # noqa: BLE001 - any import failure means "not usable"
            return Upstream(None, f"{where}: cannot import {module} ({type(e).__name__}: {e})")
    deprecated = None
    for w in caught:
        if issubclass(w.category, DeprecationWarning) and module in str(w.message):
            deprecated = deprecated or str(w.message).split(". ")[0].strip()
        else:  # not ours to hide
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    fn = getattr(mod, function, None)
    if fn is None:
        return Upstream(None, f"{where}: {module} has no {function}", deprecated)
    missing = [a for a in attrs if not hasattr(mod, a)]
    if missing:
        return Upstream(None, f"{where}: {module} lacks {', '.join(missing)}", deprecated)
    problem = signature_problem(fn, f"{module}.{function}", params)
    if problem:
        return Upstream(None, f"{where}: {problem}", deprecated)
    return Upstream(mod, None, deprecated)


class UpstreamKernel(AttentionKernel):
    """An adapter over an upstream kernel: available when its probe (`_probe`, set by the
    subclass's constructor) found it."""

    _probe: Upstream
    exact = Chunked

    @property
    def unavailable_reason(self) -> str | None:
        return self._probe.reason

    @property
    def deprecated(self) -> str | None:
        """Upstream's deprecation notice for what this adapter wraps, if it gave one."""
        return self._probe.deprecated


def with_hidden_keys(call: Call, attend: Callable[[Call], jax.Array]) -> jax.Array:
    """`attend(call)` for an upstream kernel that hides keys its own way (`hidden_logit`):
    it must not see the NaN a caller may leave beyond kv_lengths (zeroed before, under an
    infinite fill), and it averages a query row with no visible key, which gets what the
    call's fill gives it instead (`base.with_empty_rows`)."""
    return with_empty_rows(call, attend(zero_invalid_keys(call)))


def padded_length(length: int) -> int:
    """A length padded up to whole lanes, as upstream TPU kernels take it."""
    return round_up(length, LANES)


def tpu_chip(hardware: Hardware | None = None) -> Hardware:
    """The TPU a kernel is priced or traced for: `hardware` where it is a TPU of the table,
    else the one being traced for (`jaxcompat.tpu_device_kind`: a target's topology, an
    attached TPU), else TPU v5e, which hlotool names off a TPU."""
    if hardware is not None and hardware.attention_block is not None:
        return hardware
    return for_device_kind(jaxcompat.tpu_device_kind()) or get_hardware("tpu-v5e")


def block_for(padded: int, chip: Hardware) -> int:
    """The largest tile dividing a padded length, from the chip's `attention_block` halving
    down to 128 (bigger tiles amortize grid steps; the chip bounds what pays)."""
    block = chip.attention_block
    while padded % block:
        block //= 2
    return block


def tiles(q_len: int, kv_len: int, hardware: Hardware | None = None) -> tuple[int, int]:
    """(query, key) tiles of a TPU kernel for these lengths (padded to lanes) on `tpu_chip`."""
    chip = tpu_chip(hardware)
    return block_for(padded_length(q_len), chip), block_for(padded_length(kv_len), chip)


class PaddedTpuKernel(UpstreamKernel):
    """An upstream TPU kernel that takes lengths padded to lanes and hides keys its own way:
    the padded keys are hidden keys too, and every call goes through `with_hidden_keys`.
    Subclasses implement `_attend_upstream`."""

    def _hides_keys(self, call: Call) -> bool:
        return super()._hides_keys(call) or padded_length(call.k.shape[1]) != call.k.shape[1]

    def _attend(self, call: Call) -> jax.Array:
        return with_hidden_keys(call, self._attend_upstream)

    @abc.abstractmethod
    def _attend_upstream(self, call: Call) -> jax.Array:
        """[B, Lq, Hq, Dv] from upstream, for a call whose hidden keys it may see as it likes."""
