"""Attention kernels behind one interface (installed as hlotool.kernels)."""
