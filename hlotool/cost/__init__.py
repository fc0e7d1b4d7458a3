"""Cost estimates: what XLA does natively versus with the flash kernel, per chip.

Three sources, side by side: the analytic model (`model`), XLA's own analyses of compiled
programs (`xla`), and measurements on this host (`measure`); `verdict` decides per site and
chip whether the kernel pays. `split` prices a sequence split over devices: XLA's all-gather
against ring attention, per device.
"""

from typing import Any

__all__ = ["Figures", "Verdict", "analytic", "kernel_for", "verdict"]


def __getattr__(name: str) -> Any:
    # Lazy: `hlotool --help` and the measuring child start without importing jax.
    if name in ("Figures", "analytic", "kernel_for"):
        from hlotool.cost import model

        return getattr(model, name)
    if name in ("Verdict", "verdict"):
        from hlotool.cost import decision as module

        return getattr(module, name)
    raise AttributeError(f"module 'hlotool.cost' has no attribute {name!r}")
