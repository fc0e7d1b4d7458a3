"""Which kernel runs a site on a platform, and the platform-dispatching `attention`.

`per_platform` is the one place a program is split by platform
(`jax.lax.platform_dependent`): the kernel dispatcher here and `hlotool.flash_jit`'s
rewritten sites both go through it.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Callable, Hashable, Mapping, Unpack

import jax

from hlotool.kernels.base import (
    AttentionKernel, CallOptions, Features, KernelError, Support, make_call,
)
from hlotool.kernels.chunked import Chunked
from hlotool.kernels.cudnn import CudnnFlash
from hlotool.kernels.dropout_tpu import DropoutTpu
from hlotool.kernels.pallas_gpu import PallasGpuFlash
from hlotool.kernels.pallas_tpu import PallasTpuFlash
from hlotool.kernels.reference import Reference
from hlotool.kernels.splash_tpu import SplashTpu
from hlotool.kernels.tokamax import Tokamax
from hlotool.kernels.tokamax import installed as tokamax_installed
from hlotool.site import AttentionSite

_KERNELS: dict[str, AttentionKernel] = {
    k.name: k for k in (SplashTpu(), PallasTpuFlash(), DropoutTpu(), CudnnFlash(),
                        PallasGpuFlash(), Chunked(), Reference(), Tokamax("tpu"),
                        Tokamax("cuda"))
}

# Preference per platform, best first. "default" covers every platform not named (CPU).
# tokamax, where installed, comes before jax's own Pallas kernels: upstream moved attention
# there. Where it is not installed it is left out, so reasons do not list it as skipped.
# Splash comes before flash on TPU: it takes causal masks, key padding, soft-caps, sinks and
# grouped K/V heads without a dense bias or repeated heads; flash takes biases and arbitrary
# masks (as a dense bias), as their `supports` say; dropout_tpu takes dropout, which neither
# has.
# On CUDA, cuDNN (through jax.nn) first: it takes bfloat16/float16 with causal, key lengths
# and windows; then jax's Pallas Triton kernel where jax still ships it (float32 too; jax 0.12.1
# removed it), then chunked. tokamax_gpu is never preferred (see hlotool.kernels.tokamax);
# asked for by name, it says why.
_TOKAMAX = ("tokamax_tpu",) if tokamax_installed() else ()
PRIORITY: dict[str, tuple[str, ...]] = {
    "tpu": (*_TOKAMAX, "splash_tpu", "pallas_tpu", "dropout_tpu", "chunked", "reference"),
    "cuda": ("cudnn", "pallas_gpu", "chunked", "reference"),
    "default": ("chunked", "reference"),
}


def get(name: str) -> AttentionKernel:
    """The registered kernel called `name`; warns, with the reason, when it is unavailable
    (what asked for it by name then falls back, and must not do so silently)."""
    try:
        kernel = _KERNELS[name]
    except KeyError:
        raise KernelError(f"no kernel named {name!r}; known: {', '.join(names())}") from None
    if kernel.unavailable_reason is not None:
        warnings.warn(f"kernel {name} unavailable: {kernel.unavailable_reason}", stacklevel=2)
    return kernel


def names() -> list[str]:
    """Names of all registered kernels, available or not."""
    return list(_KERNELS)


def available() -> list[str]:
    """Names of the kernels the installed jax can provide."""
    return [n for n, k in _KERNELS.items() if k.unavailable_reason is None]


def registered(name: str) -> AttentionKernel:
    """The registered kernel called `name`, available or not (no warning: its `supports`
    says why where it is not)."""
    try:
        return _KERNELS[name]
    except KeyError:
        raise KernelError(f"no kernel named {name!r}; known: {', '.join(names())}") from None


def order(platform: str) -> tuple[str, ...]:
    """`platform`'s flash kernels, best first: its table without the naive reference."""
    return tuple(n for n in PRIORITY.get(platform, PRIORITY["default"]) if n != "reference")


@dataclasses.dataclass(frozen=True)
class Refusal:
    """A kernel of the table that does not take a site, and why."""

    kernel: str
    reason: str

    def __str__(self) -> str:
        return f"{self.kernel}: {self.reason}"


def first_taking(site: AttentionSite, platform: str, *, features: Features | None = None,
                 kernel: str = "auto", check_vma: bool = False
                 ) -> tuple[AttentionKernel | None, tuple[Refusal, ...]]:
    """The first kernel of `platform`'s table (`order`; or only `kernel` when one is named)
    that takes `site` with `features`, and each kernel tried before it with the reason it
    refused. check_vma: the site is in a shard_map body with check_vma=True, where a kernel
    must give its outputs jax's axis types."""
    refusals = []
    for name in ((kernel,) if kernel != "auto" else order(platform)):
        k = registered(name)
        if platform not in k.platforms:
            refusals.append(Refusal(name, f"does not run on {platform}"))
            continue
        support = k.supports(site, features)
        if support and check_vma and not k.typed_for_shard_map:
            support = Support.no(
                "gives its outputs no shard_map axis types, which jax requires in a shard_map "
                "with check_vma=True (pass check_vma=False to that shard_map to run it there)")
        if support:
            return k, tuple(refusals)
        refusals.append(Refusal(name, support.reason))
    return None, tuple(refusals)


def select(site: AttentionSite, platform: str, features: Features | None = None
           ) -> AttentionKernel:
    """The first kernel of `platform`'s table that takes `site` (the naive reference where
    none does): what `attention(kernel="auto")` runs there."""
    found, _ = first_taking(site, platform, features=features)
    return found if found is not None else _KERNELS["reference"]


# Platforms `per_platform` can give a branch of their own; every other one (CPU, ...) runs
# the "cpu" choice.
PLATFORMS = ("cpu", "tpu", "cuda")


def per_platform(choices: Mapping[str, Hashable], branch: Callable[[Any], Callable[..., Any]],
                 *args: Any) -> Any:
    """`branch(choices[p])(*args)` on each platform p of `PLATFORMS`, "cpu" standing for every
    platform not named. One traced branch per distinct choice: platforms that choose what the
    CPU chooses share its branch, and one choice everywhere needs no dispatch at all."""
    default = choices["cpu"]
    own = {p: branch(choices[p]) for p in PLATFORMS[1:] if choices[p] != default}
    if not own:
        return branch(default)(*args)
    return jax.lax.platform_dependent(*args, **own, default=branch(default))


def attention(q: jax.Array, k: jax.Array, v: jax.Array, *, kernel: str = "auto",
              **options: Unpack[CallOptions]) -> jax.Array:
    """Attention with the kernel call convention (see `hlotool.kernels.base`).

    kernel="auto" stages one branch per platform with `jax.lax.platform_dependent`, each the
    best kernel `select` finds for that platform, so the same traced function exports to TPU
    with the Pallas TPU kernel and runs on CPU with the chunked one. A kernel name forces that
    kernel everywhere.
    """
    if kernel != "auto":
        return get(kernel)(q, k, v, **options)
    call = make_call(q, k, v, **options)
    site, features = call.site(), call.features
    chosen = {p: select(site, p, features).name for p in PLATFORMS}
    arrays = ("bias", "mask", "kv_lengths")

    def branch(name: str):
        def run(q, k, v, *operands):
            return get(name)(q, k, v, **{**options, **dict(zip(arrays, operands))})
        return run

    return per_platform(chosen, branch, q, k, v, *(options.get(a) for a in arrays))
