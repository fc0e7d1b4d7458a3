"""Does the flash kernel pay for a site on a chip? One decision, with its reason and figures;
and the policy built on it: which kernel runs a site on each platform.

`hlotool cost` prints `verdict(site, target)`; `flash_jit(kernel="auto")` asks `decide(site,
platform)`, which prices the platform's chip (`chip_for`) with that same verdict.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax

from hlotool.cost.model import Figures, analytic, kernel_choice, kernel_for
from hlotool.cost.xla import xla_fuses_natively
from hlotool.hardware import Hardware, get_hardware
from hlotool import jaxcompat, kernels
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
    chip: str | Hardware,
    *,
    backward: bool = False,
    native_fused: bool | None = None,
    check_fusion: bool = True,
) -> Verdict:
    """The decision for `site` on `chip` (a name in `hlotool.hardware.HARDWARE`; "target"
    only for what XLA compiles for, `hlotool.targets`).

    native_fused: what the caller saw in the compiled program (an online-softmax custom call
    at this site); when None and `check_fusion`, a TPU chip with a deviceless compile target
    is asked by compiling the naive formula for the site's shapes.
    """
    hw = get_hardware(chip)
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

    def conclude(pays: bool, reason: str) -> Verdict:
        return Verdict(pays, reason, hw.name, kernel.name, native, flash, speedup, hbm_ratio,
                       native_fused)

    if native_fused:
        return conclude(False, "keep native (XLA already fuses it on this target: its own "
                               "online-softmax kernel never materializes the scores)")
    if native.temp_bytes > hw.hbm_bytes:
        return conclude(True, f"kernel pays (native needs {format_bytes(native.temp_bytes)} of "
                              f"temporaries, more than the {format_bytes(hw.hbm_bytes)} HBM)")
    if site.q_len * site.kv_len < SHORT_SCORES:
        return conclude(False, f"keep native (short sequence: Lq={site.q_len}, "
                               f"Lk={site.kv_len}; a {site.q_len}x{site.kv_len} score tile per "
                               "head is kernel-launch and grid overhead, which the roofline "
                               f"×{speedup:.1f} ignores)")
    if speedup >= MIN_SPEEDUP:
        return conclude(True, f"kernel pays (×{hbm_ratio:.1f} less HBM traffic, roofline "
                              f"×{speedup:.1f} faster)")
    return conclude(False, f"keep native ({_why_not(site, hw, speedup)})")


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


# ----------------------------------------------------------------------------------------
# The policy: which kernel runs a site on each platform

# Chip priced for each platform when the process does not run on one (see `chip_for`).
DEFAULT_CHIP = {"cpu": "cpu", "tpu": "tpu-v5e", "cuda": "h100"}
# Substrings of `Device.device_kind` naming a chip in `hlotool.hardware.HARDWARE`, most
# specific first ("TPU v5 lite" is a v5e, plain "TPU v5" a v5p; see jax's tpu_info.py).
_DEVICE_KINDS = {
    "tpu": (("v5 lite", "tpu-v5e"), ("v5e", "tpu-v5e"), ("v6 lite", "tpu-v6e"),
            ("v6e", "tpu-v6e"), ("v5", "tpu-v5p"), ("v4", "tpu-v4")),
    "cuda": (("a100", "a100"), ("h100", "h100"), ("h200", "h200")),
}


@dataclasses.dataclass(frozen=True)
class Choice:
    """What runs a site on one platform: a kernel name, or None for XLA's native path."""

    kernel: str | None
    reason: str


def running_platform() -> str:
    """The platform jax executes on in this process, as `lax.platform_dependent` names it
    ("cpu", "tpu", "cuda", "rocm", ...)."""
    return jaxcompat.canonicalize_platform(jax.default_backend())


@functools.cache
def chip_for(platform: str) -> str:
    """The `hlotool.hardware` chip that prices `platform`: the attached chip when jax runs on
    that platform and its `device_kind` names a known one, else `DEFAULT_CHIP[platform]`."""
    if platform != "cpu" and platform == running_platform():
        kind = jax.devices()[0].device_kind.lower()
        for part, target in _DEVICE_KINDS.get(platform, ()):
            if part in kind:
                return target
    return DEFAULT_CHIP[platform]


def decide(site: AttentionSite, platform: str, kernel: str = "auto") -> Choice:
    """The single policy deciding whether a kernel runs `site` on `platform`.

    `kernel="auto"`: the cost model's verdict for the platform's chip (`chip_for`); the
    kernel it prices runs the site where it pays. XLA:TPU's own attention fusion is probed (a
    deviceless compile, seconds per new shape) only for the platform this process runs on;
    elsewhere the reason says it was not checked. A kernel name: that kernel where it runs
    and supports the site.
    """
    if kernel != "auto":
        chosen = kernels.get(kernel)
        if platform not in chosen.platforms:
            return Choice(None, f"{kernel} does not run on {platform}")
        support = chosen.supports(site)
        return Choice(kernel, f"{kernel} requested") if support else Choice(None, support.reason)
    hw = get_hardware(chip_for(platform))
    checked = platform == running_platform()
    v = verdict(site, hw, check_fusion=checked)
    reason = v.reason if hw.name == platform else f"{v.reason} on {hw.name}"
    if v.pays and not checked and hw.platform == "tpu" and hw.compile_target is not None:
        reason += (f", XLA:TPU's own fusion not checked off-TPU (run "
                   f"`hlotool cost SCRIPT --target {hw.name}`)")
    if v.pays and v.kernel_name is not None:
        _, why = kernel_choice(site, hw)
        if "skipped" in why:  # the kernels passed over, each with its reason
            reason += f"; {why}"
    return Choice(v.kernel_name if v.pays else None, reason)
