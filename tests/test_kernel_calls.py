"""Programs that already call an attention kernel: `passes.kernel_calls` names the call
(hlotool's own rewrite, upstream Pallas flash/splash, cuDNN, tokamax) with its shapes, and
`hlotool inspect` reports it as "already a kernel" in its table and `--json`.

Checked on real lowered programs: hlotool's rewrite for CPU and TPU, upstream Pallas TPU
flash_attention (forward and gradient) and splash, lowered deviceless for TPU v5e. cuDNN and
Pallas Triton: on HLO jax lowered for CUDA on this CPU-only machine
(tests/data/hlo/generate_gpu_kernels.py). tokamax (needs Python ≥ 3.12, jax ≥ 0.11): a
program carrying the payload tokamax writes, through the same jax API tokamax uses."""

from __future__ import annotations

import json
import math
import pathlib
import textwrap

import jax
import jax.numpy as jnp
import pytest
from click.testing import CliRunner

import hlotool
from hlotool.cli import cli
from hlotool.passes.kernel_calls import find_kernel_calls, qualified_op_names
from hlotool.hlo import parse_module
from hlotool.targets import get_target

DATA = pathlib.Path(__file__).parent / "data" / "hlo"


def causal_attention(q, k, v):
    length = q.shape[1]
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1])
    s = jnp.where(jnp.tril(jnp.ones((length, length), bool)), s, -1e9)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)


SITE_LINE = causal_attention.__code__.co_firstlineno + 2  # its QKᵀ einsum


def _hlo(fn, *specs, target: str = "cpu") -> str:
    sharding = get_target(target).sharding()
    if sharding is not None:
        specs = [jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding) for s in specs]
        fn = jax.jit(fn, in_shardings=sharding, out_shardings=sharding)
    elif not hasattr(fn, "trace"):
        fn = jax.jit(fn)
    return fn.trace(*specs).lower().as_text(dialect="hlo", debug_info=True)


BLHD = jax.ShapeDtypeStruct((1, 1024, 2, 64), jnp.float32)
BHLD = jax.ShapeDtypeStruct((1, 2, 512, 128), jnp.bfloat16)


def test_hlotool_rewrite_on_cpu_is_the_chunked_kernel_at_its_site():
    text = _hlo(hlotool.flash_jit(causal_attention), BLHD, BLHD, BLHD)
    (call,) = find_kernel_calls(text, "causal_attention")
    assert (call.library, call.kernel) == ("hlotool", "chunked")
    assert call.site == f"hlotool/site1:test_kernel_calls.py:{SITE_LINE}"
    assert call.source == f"{__file__}:{SITE_LINE}"
    # The spliced call reads q, k, v as the program holds them (beside them, XLA:CPU from
    # jaxlib 0.12.1 passes in an iota it hoisted out of the call: s32[1024]).
    assert [o for o in call.operands if not o.startswith("s32[")] == ["f32[1,1024,2,64]"] * 3
    assert call.describe() == "already a kernel: chunked (hlotool)"


def test_hlotool_rewrite_on_tpu_is_splash_tpu_with_the_kernels_own_shapes():
    fast = hlotool.flash_jit(causal_attention)
    (call,) = find_kernel_calls(_hlo(fast, BLHD, BLHD, BLHD, target="tpu-v5e"))
    assert (call.library, call.kernel) == ("hlotool", "splash_tpu")
    # q, k, v as the Mosaic kernel takes them: splash runs per batch element, [H, L, D].
    assert (call.q_shape, call.k_shape, call.v_shape) == ((2, 1024, 64),) * 3
    assert call.evidence.startswith(f"op_name scope hlotool/site1:test_kernel_calls.py:"
                                    f"{SITE_LINE}/")


def _upstream_kernel_functions() -> frozenset[str]:
    import jax.experimental.pallas.ops.tpu.flash_attention as upstream

    return frozenset(n for n in dir(upstream) if n.startswith("_flash_attention_kernel"))


UPSTREAM_FLASH_KERNELS = _upstream_kernel_functions()


def _upstream_flash(q, k, v):
    from jax.experimental.pallas.ops.tpu.flash_attention import flash_attention

    return flash_attention(q, k, v, causal=True, sm_scale=0.125)


def test_upstream_pallas_flash_attention_is_named_from_its_mosaic_body():
    (call,) = find_kernel_calls(_hlo(_upstream_flash, BHLD, BHLD, BHLD, target="tpu-v5e"))
    # Which of its kernel functions names the Mosaic body varies with the jax release
    # (`_flash_attention_kernel_single_batch` on 0.10, `_flash_attention_kernel` on 0.12).
    assert call.library == "pallas" and call.kernel in UPSTREAM_FLASH_KERNELS
    assert call.evidence == f"tpu_custom_call whose Mosaic body defines {call.kernel}"
    assert (call.q_shape, call.dtype) == ((1, 2, 512, 128), "bfloat16")
    # The kernel is traced under a custom VJP: its own frames are jax's; the source is the
    # user's line that called it.
    assert call.source == f"{__file__}:{_upstream_flash.__code__.co_firstlineno + 3}"


def test_upstream_pallas_flash_gradient_is_three_kernels():
    def loss(q, k, v):
        return _upstream_flash(q, k, v).astype(jnp.float32).sum()

    grad = jax.grad(loss, argnums=(0, 1, 2))
    calls = find_kernel_calls(_hlo(grad, BHLD, BHLD, BHLD, target="tpu-v5e"))
    assert sorted(c.kernel for c in calls) == ["_flash_attention_dkv_kernel",
                                               "_flash_attention_dq_kernel",
                                               "_flash_attention_kernel"]


def test_splash_attention_is_named_from_its_op_name():
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_kernel as splash, splash_attention_mask as masks)

    mask = masks.MultiHeadMask([masks.CausalMask((512, 512))] * 2)
    kernel = splash.make_splash_mha(mask, head_shards=1, q_seq_shards=1)
    (call,) = find_kernel_calls(_hlo(jax.vmap(kernel), BHLD, BHLD, BHLD, target="tpu-v5e"))
    assert (call.library, call.kernel) == ("pallas", "splash_mha_fwd_no_residuals")
    assert "named splash_mha_fwd_no_residuals in its op_name" in call.evidence
    # Splash's first operands are its mask tables (integers); q, k, v follow.
    assert call.q_shape == (2, 512, 128)


def test_a_pallas_kernel_that_is_not_attention_is_not_reported():
    from jax.experimental import pallas as pl

    def add_one(x_ref, o_ref):
        o_ref[...] = x_ref[...] + 1

    def f(x):
        return pl.pallas_call(add_one, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype))(x)

    spec = jax.ShapeDtypeStruct((8, 128), jnp.float32)
    text = _hlo(f, spec, target="tpu-v5e")
    assert "tpu_custom_call" in text
    assert find_kernel_calls(text) == []


def test_naive_attention_is_no_kernel_call():
    assert find_kernel_calls(_hlo(causal_attention, BLHD, BLHD, BLHD)) == []


@pytest.mark.parametrize("fixture,kernels,forward_out", [
    ("cudnn_forward", ["__cudnn$fmhaSoftmax"], ("bf16[2,4,512,64]",)),
    # For training the forward also returns the softmax statistics the backward reads.
    ("cudnn_grad", ["__cudnn$fmhaSoftmax", "__cudnn$fmhaSoftmaxBackward"],
     ("bf16[2,4,512,64]", "f32[2,4,512]")),
])
def test_cudnn_fused_attention_from_a_cuda_lowering(fixture, kernels, forward_out):
    calls = find_kernel_calls((DATA / f"kernel_calls.{fixture}.cuda_pre.hlo").read_text())
    assert [c.kernel for c in calls] == kernels
    for c in calls:
        assert c.library == "cudnn"
        assert (c.q_shape, c.k_shape, c.v_shape) == ((2, 512, 4, 64),) * 3
        assert c.dtype == "bfloat16"
    # cuDNN's u8[0] workspace is no output of the attention.
    assert calls[0].out == forward_out


def test_pallas_triton_attention_from_a_cuda_lowering():
    (call,) = find_kernel_calls(
        (DATA / "kernel_calls.triton_forward.cuda_pre.hlo").read_text())
    assert (call.library, call.kernel) == ("pallas", "mha_forward")
    assert call.q_shape == (1, 256, 2, 64)
    assert call.source.endswith("generate_gpu_kernels.py:34")


TOKAMAX_PAYLOAD = json.dumps({
    "op": {"__type": "tokamax._src.ops.attention.pallas_mosaic_tpu."
                     "PallasMosaicTpuFlashAttention", "config": None},
    "arguments": {"q": "bf16[1,2,512,128]", "k": "bf16[1,2,512,128]",
                  "v": "bf16[1,2,512,128]", "bias": None, "is_causal": True},
})


@pytest.mark.skipif(jax.__version_info__ < (0, 10),
                    reason="jax 0.9 lowers set_xla_metadata into frontend attributes, "
                           "lowercased; tokamax itself needs jax >= 0.11.1")
def test_a_tokamax_op_is_one_call_named_by_its_payload():
    from jax.experimental.xla_metadata import set_xla_metadata

    def tokamax_like(q, k, v):
        # What tokamax.dot_product_attention does around its kernel (tokamax/_src/ops/op.py).
        with set_xla_metadata(xla_metadata_payload="tokamax:" + TOKAMAX_PAYLOAD):
            return _upstream_flash(q, k, v)

    calls = find_kernel_calls(_hlo(tokamax_like, BHLD, BHLD, BHLD, target="tpu-v5e"))
    # The Pallas call inside the tokamax op is the op, not a second kernel.
    assert [(c.library, c.kernel) for c in calls] == [("tokamax",
                                                      "PallasMosaicTpuFlashAttention")]
    assert calls[0].q_shape == (1, 2, 512, 128)


def test_a_tokamax_payload_of_another_op_is_not_attention():
    from jax.experimental.xla_metadata import set_xla_metadata

    payload = json.dumps({"op": {"__type": "tokamax._src.ops.normalization.api.LayerNorm"},
                          "arguments": {"x": "f32[8]"}})

    def norm(x):
        with set_xla_metadata(xla_metadata_payload="tokamax:" + payload):
            return x / jnp.linalg.norm(x)

    assert find_kernel_calls(_hlo(norm, jax.ShapeDtypeStruct((8,), jnp.float32))) == []


def test_qualified_op_names_join_names_along_calls():
    text = _hlo(hlotool.flash_jit(causal_attention), BLHD, BLHD, BLHD)
    names = qualified_op_names(parse_module(text))
    inner = [n for n in names.values() if "/chunked/" in n]
    assert inner and all(n.startswith("jit(causal_attention)/") for n in inner)


# ----------------------------------------------------------------------------------------
# hlotool inspect

FLASH_SCRIPT = """\
import math, jax, jax.numpy as jnp
import hlotool

def attention(q, k, v):
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1])
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)

q = jnp.ones((1, 1024, 2, 64), jnp.float32)
hlotool.flash_jit(attention)(q, q, q).block_until_ready()
"""

EXPORT_SCRIPT = """\
import jax, jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.flash_attention import flash_attention

def forward(q, k, v):
    return flash_attention(q, k, v, causal=True, sm_scale=0.125)

q = jax.ShapeDtypeStruct((1, 2, 512, 128), jnp.bfloat16)
jax.export.export(jax.jit(forward), platforms=["tpu"])(q, q, q)
"""


def _script(tmp_path, source: str) -> str:
    path = tmp_path / "model.py"
    path.write_text(textwrap.dedent(source))
    return str(path)


def test_inspect_reports_hlotools_own_kernel_per_target(tmp_path):
    path = _script(tmp_path, FLASH_SCRIPT)
    result = CliRunner().invoke(cli, ["inspect", path, "--target", "cpu", "--target",
                                      "tpu-v5e", "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["version"] == 1 and doc["sites"] == []  # no naive attention is left
    assert [(k["target"], k["kernel"], k["library"]) for k in doc["kernels"]] == [
        ("cpu", "chunked", "hlotool"), ("tpu-v5e", "splash_tpu", "hlotool")]
    assert all(k["source"] == f"{path}:5" and k["already_a_kernel"] for k in doc["kernels"])

    table = CliRunner(env={"COLUMNS": "250"}).invoke(cli, ["inspect", path]).stdout
    assert "0 attention sites" in table
    assert "1 call already in an attention kernel (cpu)" in table
    (row,) = [ln for ln in table.splitlines() if ln.startswith("1  attention ")
              and "hlotool" in ln]
    assert "chunked" in row and "f32[1,1024,2,64]" in row


def test_inspect_names_an_exported_pallas_tpu_kernel(tmp_path):
    path = _script(tmp_path, EXPORT_SCRIPT)
    result = CliRunner().invoke(cli, ["inspect", path, "--target", "tpu-v5e", "--json"])
    assert result.exit_code == 0, result.output
    (kernel,) = json.loads(result.stdout)["kernels"]
    assert kernel["kernel"] in UPSTREAM_FLASH_KERNELS and kernel["library"] == "pallas"
    assert kernel["q_shape"] == [1, 2, 512, 128] and kernel["source"] == f"{path}:5"
