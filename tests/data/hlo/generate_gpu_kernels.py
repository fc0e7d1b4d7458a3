"""Regenerates the CUDA kernel-call fixtures `kernel_calls.*.cuda_pre.hlo` on a CPU-only machine.

    JAX_PLATFORMS=cpu python tests/data/hlo/generate_gpu_kernels.py

`passes/kernel_calls.py` recognises cuDNN's fused attention and the Pallas Triton attention
kernel in CUDA programs; no CUDA jaxlib runs here, but jax lowers both for CUDA from the CPU
(`Traced.lower(lowering_platforms=("cuda",))`). The cuDNN path asks jaxlib's CUDA plugin for
cuDNN's version before it lowers; this script answers 9.10 in its place (the one private jax
name used: `jax._src.cudnn.fused_attention_stablehlo.check_cudnn_version`, patched here only,
never by hlotool). What XLA:GPU later compiles those calls to is not checked by this fixture.
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp

HERE = Path(__file__).resolve().parent


def cudnn_attention(q, k, v):
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")


def cudnn_loss(q, k, v):
    return cudnn_attention(q, k, v).astype(jnp.float32).sum()


def triton_attention(q, k, v):
    from jax.experimental.pallas.ops.gpu import attention

    return attention.mha(q, k, v, segment_ids=None, causal=True)


def main() -> None:
    from jax._src.cudnn import fused_attention_stablehlo  # the fixture's only private name

    fused_attention_stablehlo.check_cudnn_version = lambda: 91000
    bf16 = [jax.ShapeDtypeStruct((2, 512, 4, 64), jnp.bfloat16)] * 3
    f16 = [jax.ShapeDtypeStruct((1, 256, 2, 64), jnp.float16)] * 3
    programs = {
        "cudnn_forward": (jax.jit(cudnn_attention), bf16),
        "cudnn_grad": (jax.jit(jax.grad(cudnn_loss, argnums=(0, 1, 2))), bf16),
        "triton_forward": (jax.jit(triton_attention), f16),
    }
    for name, (fn, args) in programs.items():
        lowered = fn.trace(*args).lower(lowering_platforms=("cuda",))
        path = HERE / f"kernel_calls.{name}.cuda_pre.hlo"
        path.write_text(lowered.as_text(dialect="hlo", debug_info=True))
        print(path)


if __name__ == "__main__":
    main()
