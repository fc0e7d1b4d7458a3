"""Does the flash kernel pay for a site on a chip? One decision, with its reason and figures.

`flash_jit(kernel="auto")` asks `verdict(site, target)`; `hlotool cost` prints it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from hlotool.cost.model import Figures, analytic, kernel_for
from hlotool.cost.xla import xla_fuses_natively
from hlotool.hardware import Hardware, get_hardware
from hlotool.kernels import KernelError
from hlotool.site import AttentionSite
from hlotool.units import format_bytes

# Roofline speedup below which a custom call is not worth its opacity (profilers, updates).
MIN_SPEEDUP = 1.2
# Below this many scores per (batch, head) fixed costs (launches, grid steps, the score
# matrix staying in cache) outweigh the HBM traffic the roofline prices. Measured on CPU with
# benchmarks/flash_jit_bench.py (2-core host; 2-layer causal decoder, B=1, H=8, D=64, f32):
# flash_jit/jax.jit time 0.70-1.09 at L=128, 0.93-1.12 at 256 (no gain), 0.57 at 512, 0.30
# at 1024. TPU and GPU keep the same line until measured there.
SHORT_SCORES = 512 * 512


@dataclasses.dataclass(frozen=True)
class Verdict:
    """Whether the kernel pays for one site on one chip, and why in one line.

    native/kernel: the analytic figures (kernel None when no flash kernel takes the site).
    speedup: native roofline time / kernel's; hbm_ratio: native HBM bytes / kernel's.
    native_fused: whether XLA already fuses the naive formula there (None: not checked).
    """

    pays: bool
    reason: str
    target: str
    kernel_name: str | None
    native: Figures
    kernel: Figures | None
    speedup: float | None
    hbm_ratio: float | None
    native_fused: bool | None

    def to_json(self) -> dict[str, Any]:
        return {
            "pays": self.pays,
            "reason": self.reason,
            "target": self.target,
            "kernel_name": self.kernel_name,
            "native": self.native.to_json(),
            "kernel": None if self.kernel is None else self.kernel.to_json(),
            "speedup": self.speedup,
            "hbm_ratio": self.hbm_ratio,
            "native_fused": self.native_fused,
        }


def verdict(
    site: AttentionSite,
    target: str | Hardware,
    *,
    backward: bool = False,
    native_fused: bool | None = None,
    check_fusion: bool = True,
) -> Verdict:
    """The decision for `site` on `target` (a name in `hlotool.hardware.HARDWARE`).

    native_fused: what the caller saw in the compiled program (an online-softmax custom call
    at this site); when None and `check_fusion`, a TPU target with a deviceless compiler is
    asked by compiling the naive formula for the site's shapes.
    """
    hw = get_hardware(target)
    native = analytic(site, hw, "native", backward=backward)
    try:
        kernel = kernel_for(site, hw)
    except KernelError as e:
        return Verdict(False, f"keep native ({e})", hw.name, None, native, None, None, None,
                       native_fused)
    flash = analytic(site, hw, "kernel", backward=backward)
    speedup = native.seconds / flash.seconds
    hbm_ratio = native.hbm_bytes / flash.hbm_bytes
    if native_fused is None and check_fusion:
        native_fused = xla_fuses_natively(site, hw.compile_target)

    def decide(pays: bool, reason: str) -> Verdict:
        return Verdict(pays, reason, hw.name, kernel.name, native, flash, speedup, hbm_ratio,
                       native_fused)

    if native_fused:
        return decide(False, "keep native (XLA already fuses it on this target: its own "
                             "online-softmax kernel never materializes the scores)")
    if native.temp_bytes > hw.hbm_bytes:
        return decide(True, f"kernel pays (native needs {format_bytes(native.temp_bytes)} of "
                            f"temporaries, more than the {format_bytes(hw.hbm_bytes)} HBM)")
    if site.q_len * site.kv_len < SHORT_SCORES:
        return decide(False, f"keep native (short sequence: Lq={site.q_len}, Lk={site.kv_len}; "
                             f"a {site.q_len}x{site.kv_len} score tile per head is kernel-launch "
                             f"and grid overhead, which the roofline ×{speedup:.1f} ignores)")
    if speedup >= MIN_SPEEDUP:
        return decide(True, f"kernel pays (×{hbm_ratio:.1f} less HBM traffic, roofline "
                            f"×{speedup:.1f} faster)")
    return decide(False, f"keep native ({_why_not(site, hw, speedup)})")


def _why_not(site: AttentionSite, hw: Hardware, speedup: float) -> str:
    gain = f"roofline ×{speedup:.2f}"
    if site.mask == "additive" and _full_bias(site):
        return f"bias materialized anyway: the [B, H, Lq, Lk] bias is read from HBM, {gain}"
    if min(site.head_dim, site.v_head_dim) < hw.matrix_width:
        return (f"head dim too small: D={site.head_dim} fills {site.head_dim}/"
                f"{hw.matrix_width} of the matrix unit and the work is compute-bound, {gain}")
    return f"{gain} is below ×{MIN_SPEEDUP}"


def _full_bias(site: AttentionSite) -> bool:
    shape = site.mask_shape
    return shape is None or (len(shape) >= 2 and shape[-1] == site.kv_len
                             and shape[-2] == site.q_len)

