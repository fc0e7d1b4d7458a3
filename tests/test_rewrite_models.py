"""flash_jit on library attention layers and on the example scripts: outputs and gradients
equal jax.jit(fn), no naive site left, one `tpu_custom_call` per rewritten site in the TPU
export (none where nothing was rewritten)."""

from __future__ import annotations

import importlib.util
import pathlib
import re
import sys

import equinox as eqx
import flax.linen as nn
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import hlotool
from hlotool.passes.from_jaxpr import detect_jaxpr

B, L, H, D = 1, 512, 2, 8  # L: the shortest keys auto rewrites on CPU
E = H * D
X = jnp.asarray(np.random.default_rng(5).standard_normal((B, L, E)), jnp.float32)
EXAMPLES = pathlib.Path(__file__).parent.parent / "examples"


def relative_error(got, want) -> float:
    """max |got - want| / max |want| over all leaves of two pytrees."""
    got = np.concatenate([np.ravel(np.asarray(x, np.float64)) for x in jax.tree.leaves(got)])
    want = np.concatenate([np.ravel(np.asarray(x, np.float64)) for x in jax.tree.leaves(want)])
    return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


def custom_calls(text: str, target: str) -> int:
    """Custom calls to `target` executed by @main of an export's text: identical kernels
    lower to one private function called from each site, so calls are followed, not text
    counted."""
    direct: dict[str, int] = {}
    callees: dict[str, list[str]] = {}
    name = None
    for line in text.splitlines():
        if m := re.search(r"func\.func (?:public |private )?@([\w.$-]+)\(", line):
            name = m.group(1)
            direct[name], callees[name] = 0, []
        elif name is not None:
            direct[name] += line.count(f"stablehlo.custom_call @{target}(")
            callees[name] += re.findall(r"(?<!custom_)call @([\w.$-]+)\(", line)

    def total(f: str) -> int:
        return direct[f] + sum(total(c) for c in callees[f])

    return total("main")


def tpu_custom_calls(fn, *args, **jit_kwargs) -> int:
    """`tpu_custom_call`s executed by the TPU export of flash_jit(fn)."""
    exported = jax.export.export(hlotool.flash_jit(fn, **jit_kwargs), platforms=["tpu"])(*args)
    return custom_calls(exported.mlir_module(), "tpu_custom_call")


CUDNN = ("__cudnn$fmhaSoftmax", "__cudnn$fmhaSoftmaxBackward")


def cudnn_calls(fn, *args, **jit_kwargs) -> tuple[list[int], list[int]]:
    """cuDNN's forward and backward calls executed by the CUDA export of flash_jit(fn), and
    of the gradient of a loss of it with respect to its second argument."""
    fast = hlotool.flash_jit(fn, **jit_kwargs)
    grad = jax.jit(jax.grad(lambda *a: jnp.sum(jnp.sin(fast(*a).astype(jnp.float32))), 1))
    checks = [jax.export.DisabledSafetyCheck.custom_call(c) for c in CUDNN]
    texts = [jax.export.export(f, platforms=["cuda"], disabled_checks=checks)(*args)
             .mlir_module() for f in (fast, grad)]
    return tuple([custom_calls(text, c) for c in CUDNN] for text in texts)


def check(fn, args, sites: int, tol: float = 1e-5, **jit_kwargs) -> None:
    """Outputs equal, all `sites` rewritten and gone, one TPU kernel call per site."""
    fast = hlotool.flash_jit(fn, **jit_kwargs)
    assert relative_error(fast(*args), jax.jit(fn, **jit_kwargs)(*args)) < tol
    report = hlotool.explain(fn, *args)
    assert (len(report.sites), report.rewritten) == (sites, sites), str(report)
    assert len(detect_jaxpr(fast.trace(*args).jaxpr)) == 0
    assert tpu_custom_calls(fn, *args, **jit_kwargs) == sites


def check_grad(fn, args, argnums=0, tol: float = 1e-5) -> None:
    def loss(f):
        return lambda *a: jnp.sum(jnp.sin(f(*a)))

    want = jax.grad(loss(fn), argnums=argnums)(*args)
    got = jax.grad(loss(hlotool.flash_jit(fn)), argnums=argnums)(*args)
    assert relative_error(got, want) < tol


class LinenLayers(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.MultiHeadDotProductAttention(num_heads=H)(x, mask=nn.make_causal_mask(x[..., 0]))
        return nn.MultiHeadDotProductAttention(num_heads=H)(x)


@pytest.mark.slow
def test_flax_linen():
    model = LinenLayers()
    params = model.init(jax.random.key(0), X)

    def forward(params, x):
        return model.apply(params, x)

    check(forward, (params, X), sites=2)
    check_grad(forward, (params, X), argnums=(0, 1))


@pytest.mark.slow
def test_flax_nnx():
    layer = nnx.MultiHeadAttention(num_heads=H, in_features=E, decode=False, rngs=nnx.Rngs(0))

    def forward(x):
        return layer(x, mask=nnx.make_causal_mask(x[..., 0]))

    check(forward, (X,), sites=1)
    check_grad(forward, (X,))


class FoldedHeadsRelPos(nnx.Module):
    """ViTDet / SAM attention over a [B, GH, GW, C] grid: heads folded into the batch
    ([B·H, L, D]) and a decomposed relative-position bias computed from q (segment_anything's
    `add_decomposed_rel_pos`), added to the logits viewed as [B·H, GH, GW, GH, GW]."""

    def __init__(self, grid: tuple[int, int], rngs: nnx.Rngs):
        self.qkv = nnx.Linear(E, 3 * E, rngs=rngs)
        self.rel_h = nnx.Param(jax.random.normal(rngs.params(), (grid[0], grid[0], D)) * 0.3)
        self.rel_w = nnx.Param(jax.random.normal(rngs.params(), (grid[1], grid[1], D)) * 0.3)

    def __call__(self, x):
        b, gh, gw, _ = x.shape
        qkv = self.qkv(x.reshape(b, gh * gw, E)).reshape(b, gh * gw, 3, H, D)
        q, k, v = qkv.transpose(2, 0, 3, 1, 4).reshape(3, b * H, gh * gw, D)
        logits = (q * D ** -0.5) @ jnp.swapaxes(k, -2, -1)
        r_q = q.reshape(b * H, gh, gw, D)
        rel_h = jnp.einsum("bhwc,hkc->bhwk", r_q, self.rel_h[...])
        rel_w = jnp.einsum("bhwc,wkc->bhwk", r_q, self.rel_w[...])
        logits = (logits.reshape(b * H, gh, gw, gh, gw) + rel_h[:, :, :, :, None]
                  + rel_w[:, :, :, None, :]).reshape(b * H, gh * gw, gh * gw)
        out = jax.nn.softmax(logits, axis=-1) @ v
        return out.reshape(b, H, gh, gw, D).transpose(0, 2, 3, 1, 4).reshape(b, gh, gw, E)


@pytest.mark.slow
def test_heads_folded_into_the_batch_with_a_bias_from_q():
    """The bias reads q where the heads are folded, so the site starts there: a site of B·H
    rows and one head (#38), forward, gradient and train step equal."""
    layer = FoldedHeadsRelPos((16, 32), nnx.Rngs(0))  # L = 512
    graph, state = nnx.split(layer)
    x = X.reshape(B, 16, 32, E)

    def forward(state, x):
        return nnx.merge(graph, state)(x)

    report = hlotool.explain(forward, state, x)
    assert report.sites[0].site.q_shape == (B * H, L, D), str(report)
    check(forward, (state, x), sites=1)
    check_grad(forward, (state, x), argnums=(0, 1))
    step = jax.grad(lambda s, x: jnp.sum(jnp.sin(forward(s, x))))
    assert relative_error(hlotool.flash_jit(step)(state, x), jax.jit(step)(state, x)) < 1e-5


BLOCK = 64  # queries per block: L / BLOCK = 8 blocks


def _neighbours(x):
    """[B, n, b, H, D] -> [B, n, 3b, H, D]: each block with the one before and after it
    (zeros past either end), LongT5's `_concatenate_3_blocks`."""
    n = x.shape[1]
    padded = jnp.pad(x, ((0, 0), (1, 1), (0, 0), (0, 0), (0, 0)))
    return jnp.concatenate([padded[:, i:i + n] for i in range(3)], axis=2)


def blocked_local(q, k, v):
    """Local attention written in blocks: query i of block n sees keys within BLOCK - 1 of
    it, from blocks n - 1 .. n + 1 ([B, L/b, b, H, D] queries, [B, L/b, 3b, H, D] keys)."""
    q, k, v = (x.reshape(B, L // BLOCK, BLOCK, H, D) for x in (q, k, v))
    k, v = _neighbours(k), _neighbours(v)
    s = jnp.einsum("bnqhd,bnkhd->bnhqk", q, k) * D ** -0.5
    offset = jnp.arange(3 * BLOCK)[None, :] - jnp.arange(BLOCK)[:, None] - BLOCK
    s = jnp.where(jnp.abs(offset) < BLOCK, s, -1e10)
    return jnp.einsum("bnhqk,bnkhd->bnqhd", jax.nn.softmax(s, -1), v).reshape(B, L, H, D)


def chunked_causal(q, k, v):
    """Chunked causal attention (Llama 4's local layers) with the chunks folded into the
    batch: [B·L/b, b, H, D], causal within each chunk."""
    q, k, v = (x.reshape(B * L // BLOCK, BLOCK, H, D) for x in (q, k, v))
    s = jnp.einsum("nqhd,nkhd->nhqk", q, k) * D ** -0.5
    s = jnp.where(jnp.tril(jnp.ones((BLOCK, BLOCK), bool)), s, -jnp.inf)
    return jnp.einsum("nhqk,nkhd->nqhd", jax.nn.softmax(s, -1), v).reshape(B, L, H, D)


@pytest.mark.parametrize("fn, q_shape, k_shape, mask", [
    (blocked_local, (B, L // BLOCK, BLOCK, H, D), (B, L // BLOCK, 3 * BLOCK, H, D), "local"),
    (chunked_causal, (B * L // BLOCK, BLOCK, H, D), (B * L // BLOCK, BLOCK, H, D), "causal"),
])
def test_attention_over_blocks_of_the_sequence_is_a_site_per_block(fn, q_shape, k_shape, mask):
    """The sequence cut into blocks before Q·Kᵀ (#38): the block index is a batch axis, each
    block a short site. Its mask's structure is kept (a band within the three blocks, causal
    within a chunk), so splash takes it on TPU; chunked outputs and gradients equal jax.jit's."""
    qkv = [jnp.asarray(np.random.default_rng(i).standard_normal((B, L, H, D)), jnp.float32)
           for i in range(3)]
    (site,) = hlotool.explain(fn, *qkv, kernel="chunked").sites
    assert (site.site.q_shape, site.site.k_shape, site.site.mask) == (q_shape, k_shape, mask)
    fast = hlotool.flash_jit(fn, kernel="chunked")
    assert relative_error(fast(*qkv), jax.jit(fn)(*qkv)) < 1e-5
    grads = [jax.grad(lambda *a: jnp.sum(jnp.sin(f(*a))), argnums=(0, 1, 2))(*qkv)
             for f in (fast, jax.jit(fn))]
    assert relative_error(*grads) < 1e-5
    assert tpu_custom_calls(fn, *qkv, kernel="splash_tpu") == 1


def haiku_layer(x):
    mha = hk.MultiHeadAttention(num_heads=H, key_size=D, w_init=hk.initializers.VarianceScaling())
    return mha(x, x, x, mask=jnp.tril(jnp.ones((1, 1, L, L))))


@pytest.mark.slow
def test_haiku():
    f = hk.transform(haiku_layer)
    params = f.init(jax.random.key(0), X)

    def forward(params, x):
        return f.apply(params, None, x)

    check(forward, (params, X), sites=1)
    check_grad(forward, (params, X), argnums=(0, 1))


@pytest.mark.slow
def test_equinox_under_vmap():
    mha = eqx.nn.MultiheadAttention(num_heads=H, query_size=E, key=jax.random.key(0))

    def forward(x):
        return jax.vmap(lambda a: mha(a, a, a))(x)

    check(forward, (X,), sites=1)
    check_grad(forward, (X,))


@pytest.mark.parametrize("hkv, causal", [(H, True), (1, False)])
@pytest.mark.slow
def test_jax_nn_dot_product_attention(hkv, causal):
    rng = np.random.default_rng(6)
    q = jnp.asarray(rng.standard_normal((B, L, H, D)), jnp.float32)
    kv = jnp.asarray(rng.standard_normal((B, L, hkv, D)), jnp.float32)

    def forward(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="xla")

    check(forward, (q, kv, kv), sites=1)
    check_grad(forward, (q, kv, kv), argnums=(0, 1, 2))
    bf16 = [x.astype(jnp.bfloat16) for x in (q, kv, kv)]
    assert cudnn_calls(forward, *bf16) == ([1, 0], [1, 1])


def test_flax_linen_bfloat16():
    model = nn.MultiHeadDotProductAttention(num_heads=H, dtype=jnp.bfloat16,
                                           force_fp32_for_softmax=True)
    x = X.astype(jnp.bfloat16)
    params = model.init(jax.random.key(0), x)

    def forward(params, x):
        return model.apply(params, x)

    check(forward, (params, x), sites=1, tol=2e-2)


def load_example(name: str):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses (flax modules) look their module up
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_example_causal_decoder():
    m = load_example("causal_decoder")
    params = m.init_params(jax.random.key(0), 16, 2)
    tokens = jax.random.randint(jax.random.key(1), (1, L), 0, m.VOCAB)
    check(m.forward, (params, tokens, 2), sites=2, static_argnames="heads")
    check_grad(lambda p, t: m.forward(p, t, 2), (params, tokens))


@pytest.mark.slow
def test_example_flax_model():
    m = load_example("flax_model")
    model = m.LanguageModel(16, 2, 2)
    tokens = jax.random.randint(jax.random.key(1), (1, L), 0, m.VOCAB)
    params = jax.jit(model.init)(jax.random.key(0), tokens)
    check(m.predict, (model, params, tokens), sites=2, static_argnames="model")


@pytest.mark.slow
@pytest.mark.parametrize("dtype, tol", [("float32", 1e-5), ("bfloat16", 2e-2)])
def test_example_padded_encoder(dtype, tol):
    m = load_example("padded_encoder")
    params = m.init_params(jax.random.key(0), 16, 2, jnp.dtype(dtype))
    x = jax.random.normal(jax.random.key(1), (2, L, 16)).astype(dtype)
    lengths = jnp.array([L, L // 2])
    check(m.encode, (params, x, lengths, 2), sites=2, tol=tol, static_argnames="heads")
    # On CUDA: cuDNN, its key padding mask as key lengths, where it takes the dtype.
    fwd, bwd = cudnn_calls(lambda p, x, n: m.encode(p, x, n, 2), params, x, lengths)
    assert (fwd, bwd) == (([2, 0], [2, 2]) if dtype == "bfloat16" else ([0, 0], [0, 0]))
