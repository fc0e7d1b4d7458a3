"""Structural diff pass: hand-written modules with known answers, and real native/rewritten
pairs (naive attention vs `hlotool.kernels.attention`) lowered and compiled for TPU v5e."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from hlotool import kernels
from hlotool.capture import capture_function
from hlotool.errors import HlotoolError, HloParseError
from hlotool.passes.diff import ADDED, KEPT, REMOVED, by_site, diff_modules, site_nodes
from hlotool.site import AttentionSite

NATIVE = """HloModule native

max_r {
  x = f32[] parameter(0)
  y = f32[] parameter(1)
  ROOT m = f32[] maximum(x, y)
}

ENTRY main {
  q = f32[4,8]{1,0} parameter(0)
  k = f32[4,8]{1,0} parameter(1)
  s = f32[4,4]{1,0} dot(q, k), lhs_contracting_dims={1}, rhs_contracting_dims={1}
  e = f32[4,4]{1,0} exponential(s)
  init = f32[] constant(-inf)
  r = f32[4]{0} reduce(e, init), dimensions={1}, to_apply=max_r
  b = f32[4,4]{1,0} broadcast(r), dimensions={0}
  p = f32[4,4]{1,0} divide(e, b)
  w = f32[4,8]{1,0} parameter(2)
  o = f32[4,8]{1,0} dot(p, w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  t = f32[4,8]{1,0} tanh(o)
  ROOT out = f32[4,8]{1,0} add(t, q)
}
"""

REWRITTEN = """HloModule rewritten

ENTRY main {
  q = f32[4,8]{1,0} parameter(0)
  k = f32[4,8]{1,0} parameter(1)
  w = f32[4,8]{1,0} parameter(2)
  o = f32[4,8]{1,0} custom-call(q, k, w), custom_call_target="flash"
  t = f32[4,8]{1,0} tanh(o)
  ROOT out = f32[4,8]{1,0} add(t, q)
}
"""

# REWRITTEN as another lowering would print it: every name renumbered, parameters reordered.
RENAMED = """HloModule rewritten.7

ENTRY main.12 {
  Arg_2.3 = f32[4,8]{1,0} parameter(2)
  Arg_0.1 = f32[4,8]{1,0} parameter(0)
  Arg_1.2 = f32[4,8]{1,0} parameter(1)
  custom-call.4 = f32[4,8]{1,0} custom-call(Arg_0.1, Arg_1.2, Arg_2.3), custom_call_target="flash"
  tanh.5 = f32[4,8]{1,0} tanh(custom-call.4), metadata={op_name="jit(f)/tanh"}
  ROOT add.6 = f32[4,8]{1,0} add(tanh.5, Arg_0.1)
}
"""

SITE = AttentionSite(batch=1, q_len=4, kv_len=4, num_q_heads=1, num_kv_heads=1, head_dim=8,
                     v_head_dim=8, dtype="float32", scale=None)


def names(nodes) -> set[str]:
    return {n.split("/")[-1] for n in nodes}


def test_known_pair_counts():
    d = diff_modules(NATIVE, REWRITTEN)
    # The attention body and its reducer go; one custom-call comes; the layers around stay.
    assert names(d.removed) == {"s", "e", "init", "r", "b", "p", "o", "x", "y", "m"}
    assert names(d.added) == {"o"}
    assert sorted(names(d.mapping)) == ["k", "out", "q", "t", "w"]
    stats = d.stats(site=SITE)
    assert (stats.removed, stats.added) == (10, 1)
    assert stats.custom_calls_added == ("flash",)
    assert stats.score_buffers == (4, 0)  # s, e, b, p are [4, 4]
    assert stats.line() == "−10 instructions, +1 (1 custom-call flash), L×L buffers 4 → 0"


def test_statuses():
    d = diff_modules(NATIVE, REWRITTEN)
    assert d.status("before", "main/s") == REMOVED
    assert d.status("before", "main/t") == KEPT
    assert d.status("after", "main/o") == ADDED
    assert d.status("after", "main/t") == KEPT


def test_one_region_per_swap():
    d = diff_modules(NATIVE, REWRITTEN)
    assert len(d.regions) == 1
    assert names(d.regions[0].removed) == names(d.removed)
    assert names(d.regions[0].added) == {"o"}


def test_identical_pair_is_no_change():
    d = diff_modules(NATIVE, NATIVE)
    assert d.unchanged
    assert d.regions == []
    assert d.stats().line() == "no change"
    assert d.unified() == ""


def test_renumbered_names_are_no_change():
    d = diff_modules(REWRITTEN, RENAMED)
    assert d.unchanged, (d.removed, d.added)
    assert d.unified() == ""


def test_unified_diff_normalizes_names():
    text = diff_modules(NATIVE, REWRITTEN).unified()
    minus = [ln for ln in text.splitlines() if ln.startswith("-") and not ln.startswith("---")]
    plus = [ln for ln in text.splitlines() if ln.startswith("+") and not ln.startswith("+++")]
    # Kept instructions print identically on both sides, so only the swap shows.
    assert any("custom-call(%parameter.2, %parameter.3, %parameter.4)" in ln for ln in plus)
    assert sum(" dot(" in ln for ln in minus) == 2
    assert not any(" add(" in ln for ln in minus + plus)
    # The tanh now reads the new custom-call: the only kept line whose text changes.
    assert "%tanh.0 = f32[4,8]{1,0} tanh(%custom-call.new0)" in text


LAYER2 = """\
  s2 = f32[4,4]{1,0} dot(out, k), lhs_contracting_dims={1}, rhs_contracting_dims={1}
  e2 = f32[4,4]{1,0} exponential(s2)
  r2 = f32[4]{0} reduce(e2, init), dimensions={1}, to_apply=max_r
  b2 = f32[4,4]{1,0} broadcast(r2), dimensions={0}
  p2 = f32[4,4]{1,0} divide(e2, b2)
  o2 = f32[4,8]{1,0} dot(p2, w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  ROOT t2 = f32[4,8]{1,0} tanh(o2)
}
"""
LAYER2_REWRITTEN = """\
  o2 = f32[4,8]{1,0} custom-call(out, k, w), custom_call_target="flash"
  ROOT t2 = f32[4,8]{1,0} tanh(o2)
}
"""


def test_two_sites_two_regions():
    layer2 = NATIVE.replace("ROOT out", "out").rstrip().rstrip("}") + LAYER2
    rewritten2 = REWRITTEN.replace("ROOT out", "out").rstrip().rstrip("}") + LAYER2_REWRITTEN
    d = diff_modules(layer2, rewritten2)
    assert len(d.regions) == 2
    first, second = d.regions
    # The shared reducer belongs to the first caller's region.
    assert names(first.removed) == {"s", "e", "init", "r", "b", "p", "o", "x", "y", "m"}
    assert names(second.removed) == {"s2", "e2", "r2", "b2", "p2", "o2"}
    assert names(first.added) == {"o"} and names(second.added) == {"o2"}


def test_bad_input():
    with pytest.raises(HlotoolError, match="diff's before needs an HLO Module or its text, got int"):
        diff_modules(3, REWRITTEN)  # type: ignore[arg-type]
    with pytest.raises(HloParseError, match="<after>:"):
        diff_modules(NATIVE, "HloModule broken\nENTRY main {\n  x = f32[ parameter(0)\n}\n")


# ------------------------------------------------------------------- real pairs (TPU v5e)

B, H, L, D = 1, 2, 128, 64


def naive(q, k, v):
    """[B, H, L, D] attention written out."""
    s = jnp.einsum("bhqd,bhkd->bhqk", q, k) * D**-0.5
    return jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(s, axis=-1), v)


def flash(q, k, v):
    return kernels.attention(q, k, v, scale=D**-0.5, layout="BHLD")


def captured(fn, shape, dtype):
    x = jnp.ones(shape, dtype)
    [c] = capture_function(jax.jit(fn), x, x, x)
    return c


@pytest.fixture(scope="module")
def pair():
    return captured(naive, (B, H, L, D), jnp.float32), captured(flash, (B, H, L, D), jnp.float32)


def sites_of(module_text: str, function: str, with_nodes: bool):
    return [(site, ids if with_nodes else set(), lines)
            for site, ids, lines in site_nodes(module_text, function)]


def test_pre_optimization_tpu_pair(pair):
    native, rewritten = pair
    before = native.hlo(target="tpu-v5e")
    d = diff_modules(before, rewritten.hlo(target="tpu-v5e"))
    removed_ops = [d.instruction("before", n).opcode for n in d.removed]
    assert removed_ops.count("dot") == 2 and "exponential" in removed_ops
    assert not any(d.instruction("after", n).opcode == "dot" for n in d.added)
    assert [d.instruction("after", n).custom_call_target for n in d.added
            if d.instruction("after", n).opcode == "custom-call"] == ["tpu_custom_call"]
    [change] = by_site(d, sites_of(before, "naive", with_nodes=True))
    assert change.site is not None and change.site.q_len == L
    stats = d.stats(change.removed, change.added, change.site)
    assert stats.score_buffers is not None
    assert stats.score_buffers[0] >= 4 and stats.score_buffers[1] == 0


def test_optimized_tpu_pair_attributed_by_source_line(pair):
    native, rewritten = pair
    d = diff_modules(native.optimized("tpu-v5e"), rewritten.optimized("tpu-v5e"))
    stats = d.stats()
    assert stats.custom_calls_added == ("tpu_custom_call",)
    assert stats.fusions_removed > stats.fusions_added
    changes = by_site(d, sites_of(native.hlo(target="tpu-v5e"), "naive", with_nodes=False))
    assert [c.site is not None for c in changes] == [True]
    assert changes[0].removed == set(d.removed)


def test_xla_tpu_online_softmax_replaced():
    """At L=1024 bf16 XLA:TPU's native program already holds its own `online-softmax`
    custom call: the diff shows it leaving and the Pallas kernel's call arriving."""
    shape = (1, 2, 1024, 128)
    d = diff_modules(captured(naive, shape, jnp.bfloat16).optimized("tpu-v5e"),
                     captured(flash, shape, jnp.bfloat16).optimized("tpu-v5e"))
    stats = d.stats()
    assert stats.custom_calls_removed == ("tpu_custom_call[online-softmax]",)
    assert stats.custom_calls_added == ("tpu_custom_call",)
