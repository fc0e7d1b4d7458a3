"""The jaxpr site record is the contract with the rewrite: its q/k/v vars, layouts, scale and
mask terms must be enough to recompute the site's output exactly, in canonical terms."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_detect import (
    B, H, K, L, Q, V, alibi, arr, attend, bhld_matmul, causal_additive, causal_iota,
    extra_batch, gqa_broadcast, gqa_grouped_einsum, gqa_repeat, gqa_tile, key_padding,
    keys_first_einsum, layers, merged_batch_heads, mqa_shared_kv, no_batch, single_head,
    transposed_operands,
)

from hlotool import jaxcompat
from hlotool.kernels.reference import Reference
from hlotool.passes.from_jaxpr import detect_jaxpr, jaxpr_at
from hlotool.passes.lower import lower, operands, restore

QT, KT, VT = (x.transpose(0, 2, 1, 3) for x in (Q, K, V))
KV2 = arr(B, L, 2, 16)


def evaluate(closed: jaxcompat.ClosedJaxpr, *args) -> dict:
    """Value of every variable of the top-level jaxpr."""
    jaxpr = closed.jaxpr
    env = dict(zip(jaxpr.constvars, closed.consts)) | dict(zip(jaxpr.invars, args))

    def read(atom):
        return atom.val if isinstance(atom, jaxcompat.Literal) else env[atom]

    for eqn in jaxpr.eqns:
        subfuns, params = jaxcompat.bind_params(eqn)
        out = eqn.primitive.bind(*subfuns, *map(read, eqn.invars), **params)
        env.update(zip(eqn.outvars, out if eqn.primitive.multiple_results else [out]))
    return env


def recompute(site, env):
    """The site's output from its record alone, as a kernel computes it: lowered to a kernel
    call (`passes.lower`) and run by the reference kernel."""
    form = lower(site)
    call, after = operands(form, site, env)
    return restore(site, Reference().run(call), after)


def masked(q, k, v, mask, bias):
    return attend(q, k, v, scale=0.25, bias=bias, mask=mask, fill=-1e9)


def dpa_gqa_mask(q, k, v, mask):
    return jax.nn.dot_product_attention(q, k, v, mask=mask, implementation="xla")


MASK = jnp.asarray(np.random.default_rng(5).random((B, 1, L, L)) > 0.3)
CASES = [
    (attend, (Q, K, V)), (causal_iota, (Q, K, V)), (causal_additive, (Q, K, V)),
    (alibi, (Q, K, V)), (key_padding, (Q, K, V, jnp.array([5, 8]))),
    (masked, (Q, K, V, MASK, arr(H, L, L))), (bhld_matmul, (QT, KT, VT)),
    (keys_first_einsum, (Q, K, V)), (transposed_operands, (Q, K, V)),
    (merged_batch_heads, (Q, K, V)), (no_batch, (Q[0], K[0], V[0])),
    (single_head, (Q[0, :, 0], K[0, :, 0], V[0, :, 0])),
    (extra_batch, (Q[None].repeat(3, 0), K[None].repeat(3, 0), V[None].repeat(3, 0))),
    (gqa_repeat, (Q, KV2, KV2)), (gqa_broadcast, (Q, KV2, KV2)),
    (gqa_grouped_einsum, (Q, KV2, KV2)), (gqa_tile, (Q, KV2, KV2)),
    (mqa_shared_kv, (Q, KV2[:, :, 0], KV2[:, :, 0])),
    (dpa_gqa_mask, (Q, KV2, KV2, MASK)),
]


@pytest.mark.parametrize("fn, args", CASES, ids=[fn.__name__ for fn, _ in CASES])
@pytest.mark.sweep(keep=6)
def test_record_recomputes_the_output(fn, args):
    closed = jax.make_jaxpr(fn)(*args)
    (site,) = detect_jaxpr(closed, fn.__name__)
    assert site.path == ()
    env = evaluate(closed, *args)
    np.testing.assert_allclose(recompute(site, env), env[site.out], rtol=1e-5, atol=1e-5)
    assert site.escaping == frozenset()
    jaxpr = closed.jaxpr
    defined = {v for i in site.eqns for v in jaxpr.eqns[i].outvars}
    assert site.out in defined and site.intermediates <= defined


def test_mask_terms_in_kernel_terms():
    closed = jax.make_jaxpr(causal_iota)(Q, K, V)
    (site,) = detect_jaxpr(closed)
    assert lower(site).causal and [m.kind for m in site.masks] == ["causal"]
    assert site.masks[0].var is None

    lengths = jnp.array([5, 8])
    closed = jax.make_jaxpr(key_padding)(Q, K, V, lengths)
    (site,) = detect_jaxpr(closed)
    (mask,) = site.masks
    assert (mask.kind, mask.key_lengths) == ("boolean", closed.jaxpr.invars[3])

    closed = jax.make_jaxpr(masked)(Q, K, V, MASK, arr(H, L, L))
    bias, where = detect_jaxpr(closed)[0].masks  # in program order
    assert (bias.kind, bias.sign, where.kind, where.fill, where.keep_when) == (
        "additive", 1.0, "boolean", -1e9, True)
    assert (bias.var, where.var) == (closed.jaxpr.invars[4], closed.jaxpr.invars[3])


def test_layouts_name_the_canonical_axes():
    (site,) = detect_jaxpr(jax.make_jaxpr(gqa_grouped_einsum)(Q, KV2, KV2))
    assert (site.q.layout.roles, site.k.layout.roles, site.out_layout.roles) == (
        "BLHD", "BKHD", "BHEGL")
    assert site.q.layout.canonical == (B, L, H, 16)
    assert site.k.layout.canonical == (B, L, 2, 16)


def test_intermediate_used_elsewhere_is_reported():
    def leaky(q, k, v):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * 0.25
        p = jax.nn.softmax(s)
        return jnp.einsum("bhqk,bkhd->bqhd", p, v), p.mean()

    closed = jax.make_jaxpr(leaky)(Q, K, V)
    (site,) = detect_jaxpr(closed)
    (escaped,) = site.escaping
    assert escaped.aval.shape == (B, H, L, L)


def test_site_inside_scan_body_has_its_path():
    args = (arr(B, L, H * 16), arr(3, 3, H * 16, H * 16) / 8)
    closed = jax.make_jaxpr(layers)(*args)
    (site,) = detect_jaxpr(closed)
    (index, param), = site.path
    assert closed.jaxpr.eqns[index].primitive.name == "scan" and param == "jaxpr"
    body = jaxpr_at(closed, site.path)
    assert site.out in {v for e in body.eqns for v in e.outvars}
    assert site.q.var in {v for e in body.eqns for v in e.outvars}


def test_site_inside_jit_is_recorded_at_its_level():
    inner = jax.jit(causal_iota)

    def outer(q, k, v):
        return inner(q, k, v) * 2

    closed = jax.make_jaxpr(outer)(Q, K, V)
    (site,) = detect_jaxpr(closed)
    ((index, param),) = site.path
    assert closed.jaxpr.eqns[index].primitive.name in ("jit", "pjit") and param == "jaxpr"
    assert site.q.var is jaxpr_at(closed, site.path).invars[0]
