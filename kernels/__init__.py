"""Attention kernels behind one interface (installed as hlotool.kernels).

Registry: `get(name)`, `names()`, `available()`, `select(site, platform)`; dispatcher:
`attention(q, k, v, ..., kernel="auto")`, one traced program that lowers to the preferred kernel
of each platform (TPU → pallas_tpu, CUDA → pallas_gpu, anything else → chunked), falling back
down `PRIORITY` when a kernel is unavailable or refuses the shapes.
"""

import os

# Tests run on the host CPU; with libtpu installed jax would otherwise probe for a TPU.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from hlotool.kernels.base import (  # noqa: E402
    AttentionKernel,
    Features,
    KernelCost,
    KernelError,
    Support,
)
from hlotool.kernels.registry import (  # noqa: E402
    PRIORITY,
    attention,
    available,
    get,
    names,
    select,
)

__all__ = [
    "AttentionKernel",
    "Features",
    "KernelCost",
    "KernelError",
    "PRIORITY",
    "Support",
    "attention",
    "available",
    "get",
    "names",
    "select",
]
