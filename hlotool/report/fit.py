"""A program too big for a chip is a finding, not an error: the very shapes flash attention
exists for (an 8 TiB score matrix) are the ones XLA:TPU refuses to compile natively."""

from __future__ import annotations

import re

from hlotool.errors import DoesNotFit
from hlotool.hardware import HARDWARE
from hlotool.units import format_bytes, parse_xla_bytes

# XLA:TPU's compile-time check, e.g. "RESOURCE_EXHAUSTED: E1000: CompileTimeHbmOom: Ran out
# of memory on HBM, the total memory required for HLO temporaries (8.00T) exceeds available
# HBM (15.75G)."
_HBM_OOM = re.compile(r"CompileTimeHbmOom.*?\((\d+(?:\.\d+)?[KMGTP]?)\)[^(]*"
                      r"available HBM \((\d+(?:\.\d+)?[KMGTP]?)\)")


def does_not_fit(error: Exception | str, target: str) -> str | None:
    """The finding for a compile that failed because the program exceeds `target`'s HBM,
    e.g. "native does not fit in tpu-v5e's 16.0 GiB HBM: needs 8.0 TiB of temporaries
    (XLA:TPU sees 15.8 GiB free)"; None for any other failure."""
    if isinstance(error, DoesNotFit):
        return str(error)
    m = _HBM_OOM.search(str(error))
    if m is None:
        return None
    needs, free = (parse_xla_bytes(x) for x in m.groups())
    hw = HARDWARE.get(target)
    chip = f"{target}'s {format_bytes(hw.hbm_bytes)} HBM" if hw else f"{target}'s HBM"
    return (f"native does not fit in {chip}: needs {format_bytes(needs)} of temporaries "
            f"(XLA:TPU sees {format_bytes(free)} free)")
