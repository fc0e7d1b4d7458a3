"""hlotool: find naive attention in JAX programs and swap in flash kernels, observably."""

__version__ = "0.1.0"

__all__ = ["explain", "flash_jit"]


def __getattr__(name: str):
    # Lazy, so `import hlotool` (the CLI, reports) does not import jax and the kernels.
    if name in __all__:
        from hlotool import api

        return getattr(api, name)
    raise AttributeError(f"module 'hlotool' has no attribute {name!r}")
