"""hlotool: find naive attention in JAX programs and swap in flash kernels, observably."""

__version__ = "0.1.0"
