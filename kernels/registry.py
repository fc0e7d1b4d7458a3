"""Which kernel runs a site on a platform, and the platform-dispatching `attention`."""

from __future__ import annotations

import warnings

import jax

from hlotool.kernels.base import AttentionKernel, Features, KernelError, make_call
from hlotool.kernels.chunked import Chunked
from hlotool.kernels.pallas_gpu import PallasGpuFlash
from hlotool.kernels.pallas_tpu import PallasTpuFlash
from hlotool.kernels.reference import Reference
from hlotool.kernels.tokamax import Tokamax
from hlotool.kernels.tokamax import installed as tokamax_installed
from hlotool.site import AttentionSite

_KERNELS: dict[str, AttentionKernel] = {
    k.name: k for k in (PallasTpuFlash(), PallasGpuFlash(), Chunked(), Reference(),
                        Tokamax("tpu"), Tokamax("cuda"))
}

# Preference per platform, best first. "default" covers every platform not named (CPU).
# tokamax, where installed, comes before jax's own Pallas kernels: upstream moved attention
# there. Where it is not installed it is left out, so reasons do not list it as skipped.
# tokamax_gpu is never preferred (see hlotool.kernels.tokamax); asked for by name, it says why.
_TOKAMAX = ("tokamax_tpu",) if tokamax_installed() else ()
PRIORITY: dict[str, tuple[str, ...]] = {
    "tpu": (*_TOKAMAX, "pallas_tpu", "chunked", "reference"),
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


def attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    scale: float | None,
    bias: jax.Array | None = None,
    mask: jax.Array | None = None,
    causal: bool = False,
    kv_lengths: jax.Array | None = None,
    layout: str = "BLHD",
    kernel: str = "auto",
) -> jax.Array:
    """Attention with the kernel call convention (see `hlotool.kernels.base`).

    kernel="auto" stages one branch per platform with `jax.lax.platform_dependent`, each the
    best kernel `select` finds for that platform, so the same traced function exports to TPU
    with the Pallas TPU kernel and runs on CPU with the chunked one. A kernel name forces that
    kernel everywhere.
    """
    kwargs = dict(scale=scale, bias=bias, mask=mask, causal=causal, kv_lengths=kv_lengths,
                  layout=layout)
    if kernel != "auto":
        return get(kernel)(q, k, v, **kwargs)
    call = make_call(q, k, v, **kwargs)
    site, features = call.site(), call.features
    chosen = {p: select(site, p, features)[0] for p in ("tpu", "cuda", "default")}
    if len(set(map(id, chosen.values()))) == 1:
        return chosen["default"](q, k, v, **kwargs)

    def branch(kern: AttentionKernel):
        def run(q, k, v, bias, mask, kv_lengths):
            return kern(q, k, v, scale=scale, bias=bias, mask=mask, causal=causal,
                        kv_lengths=kv_lengths, layout=layout)
        return run

    return jax.lax.platform_dependent(
        q, k, v, bias, mask, kv_lengths,
        tpu=branch(chosen["tpu"]), cuda=branch(chosen["cuda"]),
        default=branch(chosen["default"]),
    )
