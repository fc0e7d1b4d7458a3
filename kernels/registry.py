"""Which kernel runs a site on a platform, and the platform-dispatching `attention`.

`per_platform` is the one place a program is split by platform
(`jax.lax.platform_dependent`): the kernel dispatcher here and `hlotool.flash_jit`'s
rewritten sites both go through it.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Hashable, Mapping, Unpack

import jax

from hlotool.kernels.base import AttentionKernel, CallOptions, Features, KernelError, make_call
from hlotool.kernels.chunked import Chunked
from hlotool.kernels.dropout_tpu import DropoutTpu
from hlotool.kernels.pallas_gpu import PallasGpuFlash
from hlotool.kernels.pallas_tpu import PallasTpuFlash
from hlotool.kernels.reference import Reference
from hlotool.kernels.splash_tpu import SplashTpu
from hlotool.kernels.tokamax import Tokamax
from hlotool.kernels.tokamax import installed as tokamax_installed
from hlotool.site import AttentionSite

_KERNELS: dict[str, AttentionKernel] = {
    k.name: k for k in (SplashTpu(), PallasTpuFlash(), DropoutTpu(), PallasGpuFlash(), Chunked(),
                        Reference(), Tokamax("tpu"), Tokamax("cuda"))
}

# Preference per platform, best first. "default" covers every platform not named (CPU).
# tokamax, where installed, comes before jax's own Pallas kernels: upstream moved attention
# there. Where it is not installed it is left out, so reasons do not list it as skipped.
# Splash comes before flash on TPU: it takes causal masks, key padding, soft-caps, sinks and
# grouped K/V heads without a dense bias or repeated heads; flash takes biases and arbitrary
# masks (as a dense bias), as their `supports` say; dropout_tpu takes dropout, which neither
# has.
# tokamax_gpu is never preferred (see hlotool.kernels.tokamax); asked for by name, it says why.
_TOKAMAX = ("tokamax_tpu",) if tokamax_installed() else ()
PRIORITY: dict[str, tuple[str, ...]] = {
    "tpu": (*_TOKAMAX, "splash_tpu", "pallas_tpu", "dropout_tpu", "chunked", "reference"),
    "cuda": ("pallas_gpu", "chunked", "reference"),
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


def select(
    site: AttentionSite, platform: str, features: Features | None = None
) -> tuple[AttentionKernel, str]:
    """The first kernel in `platform`'s priority that takes `site`, and why it was chosen
    (naming every kernel passed over and its reason)."""
    order = PRIORITY.get(platform, PRIORITY["default"])
    skipped = []
    for name in order:
        support = _KERNELS[name].supports(site, features)
        if support:
            why = f"{name} for {platform}"
            return _KERNELS[name], why + (f" ({'; '.join(skipped)})" if skipped else "")
        skipped.append(f"{name} skipped: {support.reason}")
    raise KernelError(f"no kernel takes this site on {platform}: {'; '.join(skipped)}")


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
    chosen = {p: select(site, p, features)[0].name for p in PLATFORMS}
    arrays = ("bias", "mask", "kv_lengths")

    def branch(name: str):
        def run(q, k, v, *operands):
            return get(name)(q, k, v, **{**options, **dict(zip(arrays, operands))})
        return run

    return per_platform(chosen, branch, q, k, v, *(options.get(a) for a in arrays))
