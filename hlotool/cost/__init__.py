"""Cost estimates: what XLA does natively versus with the flash kernel, per chip.

Three sources, side by side: the analytic model (`model`), XLA's own analyses of compiled
programs (`xla`), and measurements on this host (`measure`); `verdict` decides per site and
chip whether the kernel pays.
"""

from hlotool.cost.model import Figures, analytic, kernel_for
from hlotool.cost.verdict import Verdict, verdict

__all__ = ["Figures", "Verdict", "analytic", "kernel_for", "verdict"]
