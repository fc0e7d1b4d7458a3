"""Attention kernels behind one interface (installed as hlotool.kernels).

Registry: `get(name)`, `names()`, `available()`, `select(site, platform)`; dispatcher:
`attention(q, k, v, ..., kernel="auto")`, one traced program that lowers to the preferred kernel
of each platform (TPU → tokamax_tpu where tokamax is installed, else pallas_tpu; CUDA →
pallas_gpu; anything else → chunked), falling back down `PRIORITY` when a kernel is unavailable
or refuses the shapes.
"""

from hlotool.kernels.base import (
    AttentionKernel,
    Features,
    KernelCost,
    KernelError,
    Support,
)
from hlotool.kernels.registry import (
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
