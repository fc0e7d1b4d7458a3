"""Attention kernels behind one interface (installed as hlotool.kernels).

Registry: `get(name)`, `names()`, `available()`; the table per platform, `order(platform)`, and
`first_taking(site, platform)`, which walks it keeping each `Refusal`; dispatcher:
`attention(q, k, v, ..., kernel="auto")`, one traced program that lowers to the preferred kernel
of each platform (TPU → tokamax_tpu where tokamax is installed, else splash_tpu, pallas_tpu for
what splash refuses, dropout_tpu for dropout; CUDA → pallas_gpu; anything else → chunked), falling back down `PRIORITY`
when a kernel is unavailable or refuses the shapes; `per_platform`, the one place a program
is split by platform. `sharded.on_mesh` runs a call per shard of a mesh.
"""

from hlotool.kernels.base import (
    AttentionKernel,
    Features,
    KernelCost,
    KernelError,
    Support,
)
from hlotool.kernels.registry import (
    PLATFORMS,
    PRIORITY,
    Refusal,
    attention,
    available,
    first_taking,
    get,
    names,
    order,
    per_platform,
    registered,
    select,
)

__all__ = [
    "AttentionKernel",
    "Features",
    "KernelCost",
    "KernelError",
    "PLATFORMS",
    "PRIORITY",
    "Refusal",
    "Support",
    "attention",
    "available",
    "first_taking",
    "get",
    "names",
    "order",
    "per_platform",
    "registered",
    "select",
]
