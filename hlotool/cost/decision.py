"""Which kernel runs a site on a platform: one decision, `choose`, and the verdict it rests on.

`choose(site, platform)` walks the platform's table of kernels in order (`kernels.first_taking`),
keeps each refusal with its reason, and prices the first kernel that takes the site against
what XLA does natively on the platform's chip (`verdict`). `flash_jit`, `explain`, `cost`,
`rewrite`, `diff`, `profile` and the cost plot all read that one `Choice`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax

from hlotool.cost.model import Figures, analytic
from hlotool.cost.xla import xla_fuses_natively
from hlotool.errors import DoesNotFit, HlotoolError, first_line
from hlotool.hardware import Hardware, get_hardware
from hlotool import jaxcompat, kernels
from hlotool.kernels import AttentionKernel, Refusal
from hlotool.site import AttentionSite
from hlotool.targets import tpu_compiler_loaded
from hlotool.units import format_bytes, format_seconds

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

    native/kernel: the analytic figures (kernel None when no flash kernel takes the site);
    native is XLA's own online-softmax call where XLA:TPU's attention pass takes the site
    (`native_fused`), else the unfused program. speedup: native roofline time / kernel's;
    hbm_ratio: native HBM bytes / kernel's. native_fused: whether XLA fuses the naive formula
    there (None: not known). refusals: the kernels of the table passed over, each with why.
    """

    pays: bool
    why: str  # the reason without its decision: "short sequence: …"
    target: str
    kernel_name: str | None
    native: Figures
    kernel: Figures | None
    speedup: float | None
    hbm_ratio: float | None
    native_fused: bool | None
    refusals: tuple[Refusal, ...] = ()

    @property
    def decision(self) -> str:
        return "kernel pays" if self.pays else "keep native"

    @property
    def reason(self) -> str:
        """The verdict as one line: "keep native (short sequence: …)"."""
        return f"{self.decision} ({self.why})"

    def to_json(self) -> dict[str, Any]:
        return {
            "pays": self.pays,
            "decision": self.decision,
            "reason": self.reason,
            "why": self.why,
            "target": self.target,
            "kernel_name": self.kernel_name,
            "native": self.native.to_json(),
            "kernel": None if self.kernel is None else self.kernel.to_json(),
            "speedup": self.speedup,
            "hbm_ratio": self.hbm_ratio,
            "native_fused": self.native_fused,
            "refusals": [dataclasses.asdict(r) for r in self.refusals],
        }


def verdict(
    site: AttentionSite,
    chip: str | Hardware,
    *,
    kernel: AttentionKernel | None = None,
    refusals: tuple[Refusal, ...] = (),
    backward: bool = False,
    native_fused: bool | None = None,
    check_fusion: bool = True,
) -> Verdict:
    """The decision for `site` on `chip` (a name in `hlotool.hardware.HARDWARE`; "target"
    only for what XLA compiles for, `hlotool.targets`), pricing `kernel` (default: the first
    of the chip's platform's table that takes the site) against what XLA does natively.

    native_fused: what the caller saw in the compiled program (an online-softmax custom call
    at this site); when None and `check_fusion`, a TPU chip with a deviceless compile target
    is asked by compiling the naive formula for the site's shapes (once per shape).
    """
    hw = get_hardware(chip)
    if kernel is None and not refusals:
        kernel, refusals = kernels.first_taking(site, hw.platform)
    native = analytic(site, hw, "native", backward=backward)
    if kernel is None:
        why = "; ".join(map(str, refusals)) or f"no kernel runs on {hw.platform}"
        return Verdict(False, f"no flash kernel takes it: {why}", hw.name, None,
                       native, None, None, None, native_fused, refusals)
    flash = analytic(site, hw, "kernel", backward=backward, kernel=kernel)

    def conclude(pays: bool, why: str, native: Figures = native,
                 fused: bool | None = native_fused) -> Verdict:
        return Verdict(pays, why, hw.name, kernel.name, native, flash,
                       native.seconds / flash.seconds, native.hbm_bytes / flash.hbm_bytes,
                       fused, refusals)

    if native.temp_bytes > hw.hbm_bytes:
        return conclude(True, f"native needs {format_bytes(native.temp_bytes)} of "
                              f"temporaries, more than the {format_bytes(hw.hbm_bytes)} HBM")
    if site.decode and native.seconds / flash.seconds < MIN_SPEEDUP:
        kv = site.batch * site.kv_len * site.num_kv_heads * (site.head_dim + site.v_head_dim) \
            * site.itemsize
        return conclude(False, f"decode step ({site.q_len} query row{'s' * (site.q_len > 1)}"
                               f" against {site.kv_len} keys): it reads K and V once "
                               f"({format_bytes(kv)}, {format_seconds(native.seconds)} "
                               f"{native.bound}-bound) and writes no L×L buffer; the kernel's "
                               f"roofline ×{native.seconds / flash.seconds:.2f} leaves "
                               "nothing to win")
    if site.q_len * site.kv_len < SHORT_SCORES:
        speedup = native.seconds / flash.seconds
        return conclude(False, f"short sequence: Lq={site.q_len}, "
                               f"Lk={site.kv_len}; a {site.q_len}x{site.kv_len} score tile per "
                               "head is kernel-launch and grid overhead, which the roofline "
                               f"×{speedup:.1f} ignores")
    unchecked = ""
    if native_fused is None and check_fusion:
        native_fused, why = _fuses(site, hw)
        if why:
            unchecked = f"; XLA:TPU's own attention fusion not checked: {why}"
    if native_fused:
        # Priced against XLA's own online-softmax call, not the unfused program.
        native = analytic(site, hw, "fused", backward=backward)
    speedup, hbm_ratio = native.seconds / flash.seconds, native.hbm_bytes / flash.hbm_bytes
    own = f"XLA:{hw.platform.upper()}'s own online-softmax fusion" if native_fused else ""
    if speedup >= MIN_SPEEDUP:
        than = f" than {own}" if own else ""
        return conclude(True, f"×{hbm_ratio:.1f} less HBM traffic, roofline "
                              f"×{speedup:.1f} faster{than}{unchecked}", native, native_fused)
    if own:
        return conclude(False, f"{own} is as good: roofline ×{speedup:.2f}",
                        native, native_fused)
    return conclude(False, f"{_why_not(site, hw, speedup)}{unchecked}", native,
                    native_fused)


def _fuses(site: AttentionSite, hw: Hardware) -> tuple[bool | None, str]:
    """Whether XLA's attention pass takes `site` on `hw` (a deviceless compile, cached per
    shape), and why it is not known where it is not (no compiler for the chip here)."""
    if hw.platform == "tpu" and hw.compile_target is not None and not tpu_compiler_loaded():
        return None, ("no TPU compiler loaded in this process (hlotool's commands load one: "
                      "`hlotool cost SCRIPT` checks)")
    try:
        return xla_fuses_natively(site, hw.compile_target), ""
    except DoesNotFit:
        return False, ""  # a program that does not fit has no fusion to offer
    except HlotoolError as e:
        return None, first_line(e)


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
    """What runs a site on one platform, and everything that decided it: the kernel (None:
    XLA's native path), why in one line, the kernels of the table that refused the site,
    each with its reason, and the verdict that priced the first that took it (None where a
    kernel was named, or none took it). Every command reads these records; none parses the
    reason back."""

    platform: str
    kernel: str | None
    reason: str
    refusals: tuple[Refusal, ...] = ()
    verdict: Verdict | None = None

    @property
    def priced(self) -> str | None:
        """The kernel the platform would run if it paid (the one the verdict priced)."""
        if self.kernel is not None:
            return self.kernel
        return self.verdict.kernel_name if self.verdict is not None else None

    @property
    def chip(self) -> str | None:
        """The chip the platform was priced on ("tpu-v5e" for tpu), where it was."""
        return self.verdict.target if self.verdict is not None else None

    def to_json(self) -> dict[str, Any]:
        return {"platform": self.platform, "kernel": self.kernel, "reason": self.reason,
                "refusals": [dataclasses.asdict(r) for r in self.refusals],
                "verdict": None if self.verdict is None else self.verdict.to_json()}


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


def choose(site: AttentionSite, platform: str, kernel: str = "auto", *,
           features: Any = None, check_vma: bool = False, backward: bool = False,
           chip: str | None = None, native_fused: bool | None = None,
           check_fusion: bool = True) -> Choice:
    """The one decision: which kernel runs `site` on `platform`.

    The platform's table of kernels is tried in order (`kernels.first_taking`), each refusal
    kept; with `kernel="auto"` the first that takes the site is priced against XLA's native path
    on the platform's chip (`chip_for`, or `chip`) and runs where it pays. A kernel name:
    that kernel, where it runs and takes the site. backward: price forward and backward (the
    site's derivative is in the program: a train step)."""
    found, refusals = kernels.first_taking(site, platform, features=features, kernel=kernel,
                                           check_vma=check_vma)
    if kernel != "auto":
        if found is None:
            return Choice(platform, None, str(refusals[-1]), refusals)
        return Choice(platform, kernel, f"{kernel} requested", refusals)
    v = verdict(site, chip or chip_for(platform), kernel=found, refusals=refusals,
                backward=backward, native_fused=native_fused, check_fusion=check_fusion)
    return Choice(platform, v.kernel_name if v.pays else None, v.reason, refusals, v)
