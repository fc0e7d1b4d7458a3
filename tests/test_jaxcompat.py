"""The seam to jax internals (hlotool/jaxcompat.py), what a missing hook degrades, the
kernel providers across jax versions, tokamax, and the packaging decisions behind them."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import pathlib
import re
import sys
import types
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

import hlotool
from hlotool import doctor, jaxcompat, kernels, targets
from hlotool.capture import capture_function
from hlotool.errors import HlotoolError
from hlotool.kernels import registry
from hlotool.kernels import tokamax as tokamax_kernel
from hlotool.kernels._upstream import probe as probe_upstream

ROOT = pathlib.Path(__file__).resolve().parents[1]
JAX = f"jax {jax.__version__}"
SEAM = ROOT / "hlotool" / "jaxcompat.py"
# `jax._src` spelled as code or as an import string (`importlib.import_module("jax._src…")`).
_PRIVATE = re.compile(r"\bjax\s*\.\s*_src\b|from\s+jax\s+import\s+[^\n]*\b_src\b")


def private_uses(text: str) -> list[int]:
    """Line numbers of `text` that reach into `jax._src`."""
    return [n for n, line in enumerate(text.splitlines(), 1) if _PRIVATE.search(line)]


def test_private_use_detector_catches_each_spelling():
    sample = ("from jax._src import core\nimport jax._src.interpreters.pxla as pxla\n"
              "from jax import _src\nx = importlib.import_module('jax._src.core')\n"
              "import jax.extend.core\n# jax/_src/pallas/triton is a path, not an import\n")
    assert private_uses(sample) == [1, 2, 3, 4]


def test_no_jax_src_outside_the_seam():
    offenders = []
    for folder in ("hlotool", "kernels", "passes"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path != SEAM:
                offenders += [f"{path.relative_to(ROOT)}:{n}"
                              for n in private_uses(path.read_text())]
    assert offenders == []
    assert private_uses(SEAM.read_text())  # the seam itself is where they went


def test_every_hook_is_found_on_this_jax():
    assert list(jaxcompat.HOOKS) == [
        "jit lowering", "jaxpr types", "jaxpr evaluation", "eval context",
        "dead-code elimination", "source lines", "source exclusion", "platform names",
        "softmax switch", "cuDNN version", "TPU topologies"]
    assert [h.name for h in jaxcompat.HOOKS.values() if not h.ok] == []
    assert {h.name for h in jaxcompat.HOOKS.values() if h.private} == {
        "jit lowering", "eval context", "dead-code elimination", "source lines",
        "platform names", "cuDNN version"}
    assert all(jaxcompat.missing(f) is None for f in jaxcompat.FEATURES)
    assert jaxcompat.ClosedJaxpr is jax.extend.core.ClosedJaxpr


def test_probe_takes_the_first_candidate_that_has_it(fake_module):
    fake_module("fake_public")
    fake_module("fake_private", f=lambda jaxpr, used_outputs: None)
    hook, (f,) = jaxcompat.probe("f", "testing", ("fake_public", "fake_private"), ("f",),
                                 params=("jaxpr",), prefix=True)
    assert hook.ok and hook.api == "fake_private.f" and f is sys.modules["fake_private"].f


def test_probe_names_the_jax_version_and_what_is_missing(fake_module):
    fake_module("fake_pxla")
    hook, (value,) = jaxcompat.probe("jit lowering", "capture", ("fake_pxla", "no_such_mod"),
                                     ("lower_sharding_computation",))
    assert value is None and not hook.ok
    assert hook.reason == (f"{JAX}: fake_pxla has no lower_sharding_computation; cannot import "
                           "no_such_mod (No module named 'no_such_mod')")
    assert str(jaxcompat.MissingHook(hook)) == (
        f"capture unavailable: {hook.reason} (see `hlotool doctor`)")


def test_probe_checks_leading_parameters(fake_module):
    fake_module("fake_pxla", lower_sharding_computation=lambda jaxpr, name: None)
    hook, _ = jaxcompat.probe("jit lowering", "capture", ("fake_pxla",),
                              ("lower_sharding_computation",),
                              params=("closed_jaxpr", "api_name"), prefix=True)
    assert hook.reason == (f"{JAX}: fake_pxla.lower_sharding_computation takes ('jaxpr', "
                           "'name'), expected ('closed_jaxpr', 'api_name')")


def test_lowering_hook_is_removed_after_a_failing_capture():
    module, _, attr = jaxcompat.HOOKS["jit lowering"].api.rpartition(".")
    original = getattr(sys.modules[module], attr)
    with pytest.raises(ZeroDivisionError):
        capture_function(lambda: 1 / 0)
    assert getattr(sys.modules[module], attr) is original


def _attention(q, k, v):
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * 0.125
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)


QKV = [jax.random.normal(jax.random.PRNGKey(i), (1, 512, 2, 64)) for i in range(3)]


@pytest.fixture
def without_dce(monkeypatch, fake_module):
    """This jax as if it had no `dce_jaxpr`: the hook probed against a partial_eval without
    it, and the seam's name bound to the stand-in, as the import would have left them."""
    fake_module("fake_partial_eval")
    hook, _ = jaxcompat.probe("dead-code elimination",
                              jaxcompat.HOOKS["dead-code elimination"].used_by,
                              ("fake_partial_eval",), ("dce_jaxpr",))
    monkeypatch.setitem(jaxcompat.HOOKS, hook.name, hook)
    monkeypatch.setattr(jaxcompat, "dce_jaxpr", jaxcompat._raising(hook))
    return hook


def test_missing_hook_degrades_flash_jit_to_plain_jit(without_dce):
    with pytest.warns(UserWarning) as caught:
        fast = hlotool.flash_jit(_attention)
    (warning,) = caught
    assert str(warning.message) == (
        f"flash_jit, hlotool rewrite and diff unavailable: {JAX}: fake_partial_eval has no "
        "dce_jaxpr (see `hlotool doctor`); flash_jit returns plain jax.jit")
    assert str(fast.trace(*QKV).jaxpr) == str(jax.jit(_attention).trace(*QKV).jaxpr)
    np.testing.assert_array_equal(fast(*QKV), jax.jit(_attention)(*QKV))


def test_missing_hook_is_one_line_where_flash_jit_cannot_degrade(without_dce):
    """`hlotool rewrite` and `diff` rewrite a captured program: no plain-jit fallback there."""
    from hlotool.api import rewrite_captured

    (f,) = capture_function(jax.jit(_attention), *QKV)
    with pytest.raises(jaxcompat.MissingHook) as err:
        rewrite_captured(f)
    assert isinstance(err.value, HlotoolError) and "\n" not in str(err.value)
    assert str(err.value).endswith("fake_partial_eval has no dce_jaxpr (see `hlotool doctor`)")
    (site,) = hlotool.explain(_attention, *QKV).sites  # explain rewrites nothing: it works
    assert site.kernels["cpu"] == "chunked"


def test_inspect_keeps_working_without_the_flash_hooks(without_dce):
    (f,) = capture_function(jax.jit(_attention), *QKV)
    assert f.name == "_attention" and f.instruction_counts()["jaxpr"] > 5


def test_capture_without_its_hook_is_one_line(monkeypatch, fake_module):
    fake_module("fake_pxla")
    hook, _ = jaxcompat.probe("jit lowering", "capture (inspect, dump, cost, rewrite, diff)",
                              ("fake_pxla",), ("lower_sharding_computation",))
    monkeypatch.setattr(jaxcompat, "_lowering_hook", hook)
    with pytest.raises(jaxcompat.MissingHook, match=r"^capture \(inspect, dump, cost, rewrite, "
                       rf"diff\) unavailable: {re.escape(JAX)}: fake_pxla has no "):
        capture_function(jax.jit(_attention), *QKV)


def test_cosmetic_hooks_degrade_quietly(monkeypatch):
    monkeypatch.setattr(jaxcompat, "_user_frames", None)
    monkeypatch.setattr(jaxcompat, "_canonicalize", None)
    assert list(jaxcompat.user_frames(None)) == []
    assert jaxcompat.canonicalize_platform("gpu") == "gpu"
    (site,) = hlotool.explain(_attention, *QKV).sites
    assert site.site.source == ""


# --- kernel providers ------------------------------------------------------------------


def test_upstream_probe_keeps_deprecation_notices_out_of_the_users_way(fake_module):
    def deprecated_import():
        warnings.warn("fake_ops is deprecated. Please use tokamax instead.", DeprecationWarning)
        warnings.warn("an unrelated warning", UserWarning)

    class Loader:
        def create_module(self, spec):
            return None

        def exec_module(self, module):
            deprecated_import()
            module.mha = lambda q, k, v: None

    spec = importlib.util.spec_from_loader("fake_ops", Loader())
    sys.modules.pop("fake_ops", None)
    finder = types.SimpleNamespace(find_spec=lambda name, path, target=None:
                                   spec if name == "fake_ops" else None)
    sys.meta_path.insert(0, finder)
    try:
        with pytest.warns(UserWarning, match="an unrelated warning"):
            found = probe_upstream("fake_ops", "mha", ("q", "k", "v"))
    finally:
        sys.meta_path.remove(finder)
        sys.modules.pop("fake_ops", None)
    assert found.reason is None and found.module.mha is not None
    assert found.deprecated == "fake_ops is deprecated"


def test_jax_gpu_attention_deprecation_is_recorded_where_jax_announces_it():
    source = pathlib.Path(jax.__file__).parent / "experimental/pallas/ops/gpu/attention.py"
    if not source.exists():
        pytest.skip(f"jax {jax.__version__} no longer ships {source.name} (next test)")
    gpu = kernels.get("pallas_gpu")
    assert gpu.unavailable_reason is None and not gpu.optional
    announced = "is deprecated" in source.read_text()
    assert (gpu.deprecated is not None) == announced
    if announced:
        assert gpu.deprecated == "jax.experimental.pallas.ops.gpu.attention is deprecated"


def test_jax_gpu_attention_removed_upstream_is_off_not_broken():
    """jax 0.12.1 deleted the Triton attention op: pallas_gpu is off with that reason, doctor
    does not fail on it, and CUDA sites go to the next kernel."""
    source = pathlib.Path(jax.__file__).parent / "experimental/pallas/ops/gpu/attention.py"
    if source.exists():
        pytest.skip(f"jax {jax.__version__} still ships {source.name} (previous test)")
    gpu = registry.registered("pallas_gpu")
    assert gpu.optional
    assert gpu.unavailable_reason == (
        f"jax {jax.__version__} removed jax.experimental.pallas.ops.gpu.attention (deprecated "
        "in 0.12.0 for tokamax); CUDA sites run in the next kernel")
    (check,) = [c for c in doctor.kernel_checks() if c.what == "kernel pallas_gpu"]
    assert check.status == doctor.OFF
    def attention(q, k, v):  # softmax written out: jax.nn.softmax's custom_jvp stays native
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * 0.125
        p = jnp.exp(s - s.max(-1, keepdims=True))
        return jnp.einsum("bhqk,bkhd->bqhd", p / p.sum(-1, keepdims=True), v)

    (site,) = hlotool.explain(attention, *QKV).sites
    assert site.kernels["cuda"] == registry.select(site.site, "cuda").name == "chunked"
    assert "pallas_gpu: pallas_gpu unavailable: jax " in site.reason


@pytest.mark.parametrize("custom_jvp", [True, False])
def test_jax_nn_softmax_sites_are_rewritten_whether_or_not_it_is_a_custom_jvp(custom_jvp):
    """jax 0.12.1 makes jax.nn.softmax a custom_jvp call (`jax_softmax_custom_jvp` on);
    hlotool finds the site in the program traced with the switch off, on every jax, and the
    rewrite keeps the outputs and gradients."""
    def loss(q, k, v):
        return jnp.sum(jnp.sin(hlotool.flash_jit(_attention)(q, k, v)))

    def naive_loss(q, k, v):
        return jnp.sum(jnp.sin(_attention(q, k, v)))

    with jax.softmax_custom_jvp(custom_jvp):
        assert hlotool.explain(_attention, *QKV).rewritten == 1
        got = jax.jit(jax.value_and_grad(loss, (0, 1, 2)))(*QKV)
        want = jax.jit(jax.value_and_grad(naive_loss, (0, 1, 2)))(*QKV)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=0,
                                   atol=2e-5 * float(np.max(np.abs(w))))


def test_without_the_softmax_switch_a_custom_jvp_softmax_site_stays_native(monkeypatch):
    monkeypatch.setattr(jaxcompat, "_softmax_switch", None)
    with jax.softmax_custom_jvp(True):
        (site,) = hlotool.explain(_attention, *QKV).sites
        out = hlotool.flash_jit(_attention)(*QKV)
    assert not site.rewritten
    assert site.reason.startswith("part of the attention is inside a custom_jvp_call (_softmax")
    np.testing.assert_array_equal(np.asarray(out), np.asarray(jax.jit(_attention)(*QKV)))


def test_kernel_asked_for_by_name_warns_when_unavailable(monkeypatch):
    monkeypatch.setitem(sys.modules, "jax.experimental.pallas.ops.tpu.flash_attention", None)
    from hlotool.kernels.pallas_tpu import PallasTpuFlash

    monkeypatch.setitem(registry._KERNELS, "pallas_tpu", PallasTpuFlash())
    with pytest.warns(UserWarning, match=rf"^kernel pallas_tpu unavailable: {re.escape(JAX)}: "
                      "cannot import jax.experimental.pallas.ops.tpu.flash_attention"):
        report = hlotool.explain(_attention, *QKV, kernel="pallas_tpu")
    (site,) = report.sites
    assert site.kernels["tpu"] is None
    assert "pallas_tpu unavailable" in site.reason


def test_tokamax_gpu_is_offered_with_its_reason():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gpu = kernels.get("tokamax_gpu")
    assert gpu.platforms == ("cuda",) and "tokamax_gpu" not in registry.PRIORITY["cuda"]
    if tokamax_kernel.installed():
        assert gpu.unavailable_reason.startswith("untested: tokamax's GPU kernels")
    else:
        assert gpu.unavailable_reason == f"tokamax not installed: {tokamax_kernel.INSTALL}"


needs_tokamax = pytest.mark.skipif(not tokamax_kernel.installed(),
                                   reason="tokamax is not installed (hlotool[tokamax])")


@pytest.fixture
def tokamax_preferred(monkeypatch):
    """The registry's own preference where tokamax is installed (conftest pins pallas_tpu)."""
    monkeypatch.setitem(registry.PRIORITY, "tpu", ("tokamax_tpu", "splash_tpu", "pallas_tpu",
                                                   "chunked", "reference"))


@needs_tokamax
def test_tokamax_is_preferred_on_tpu_where_it_takes_the_site(tokamax_preferred):
    from hlotool.kernels.base import Features
    from hlotool.site import AttentionSite

    site = AttentionSite(batch=1, q_len=1024, kv_len=1024, num_q_heads=8, num_kv_heads=2,
                         head_dim=128, v_head_dim=128, dtype="bfloat16", scale=0.1)
    assert kernels.select(site, "tpu").name == "tokamax_tpu"
    kernel, refusals = kernels.first_taking(site, "tpu", features=Features(bias=True))
    assert kernel.name == "pallas_tpu"
    assert [str(r) for r in refusals] == [
        "tokamax_tpu: additive bias unsupported (tokamax mosaic_tpu takes none)",
        "splash_tpu: additive bias unsupported (splash takes none; pallas_tpu does)"]


@needs_tokamax
def test_tokamax_exports_for_tpu_and_cpu_runs_chunked(tokamax_preferred):
    x = jax.ShapeDtypeStruct((1, 1000, 2, 128), jnp.float32)
    attend = lambda q, k, v: kernels.attention(q, k, v, scale=0.1, causal=True)  # noqa: E731
    fwd = export.export(jax.jit(attend), platforms=["tpu"])(x, x, x).mlir_module()
    assert fwd.count("tpu_custom_call") == 1 and "splash" in fwd
    grad = jax.grad(lambda q, k, v: attend(q, k, v).sum(), argnums=(0, 1, 2))
    bwd = export.export(jax.jit(grad), platforms=["tpu"])(x, x, x).mlir_module()
    assert bwd.count("tpu_custom_call") == 2  # forward, fused backward
    q = jax.random.normal(jax.random.PRNGKey(0), (1, 1000, 2, 128))
    lowered = jax.jit(attend).lower(q, q, q).as_text()
    assert "tpu_custom_call" not in lowered and "while" in lowered  # the chunked kernel


@needs_tokamax
def test_flash_jit_exports_tokamax_for_tpu(tokamax_preferred):
    x = jax.ShapeDtypeStruct((1, 2048, 2, 128), jnp.bfloat16)
    fast = hlotool.flash_jit(_attention)
    text = export.export(fast, platforms=["tpu"])(x, x, x).mlir_module()
    assert text.count("tpu_custom_call") == 1 and "splash" in text
    (site,) = hlotool.explain(_attention, x, x, x).sites
    assert site.kernels["tpu"] == "tokamax_tpu"


@needs_tokamax
@pytest.mark.parametrize("name", ["causal_lq_ne_lk", "gqa_causal", "key_padding_nan",
                                  "boolean_mask", "bf16_causal"])
def test_tokamax_matches_the_reference_in_tpu_interpret_mode(name):
    from jax.experimental.pallas import tpu as pltpu
    from test_kernels_numerics import CASES, _check

    (case,) = [c for c in CASES if c.name == name]
    with pltpu.force_tpu_interpret_mode(True):
        _check(kernels.get("tokamax_tpu"), case)


@needs_tokamax
def test_tokamax_per_head_mask_and_own_value_dim():
    from jax.experimental.pallas import tpu as pltpu

    keys = jax.random.split(jax.random.PRNGKey(3), 4)
    q = jax.random.normal(keys[0], (2, 100, 4, 64))
    k = jax.random.normal(keys[1], (2, 100, 2, 64))
    v = jax.random.normal(keys[2], (2, 100, 2, 32))
    mask = jax.random.bernoulli(keys[3], 0.7, (2, 4, 100, 100))
    with pltpu.force_tpu_interpret_mode(True):
        out = kernels.get("tokamax_tpu")(q, k, v, scale=0.2, mask=mask, causal=True)
    ref = kernels.get("reference")(q, k, v, scale=0.2, mask=mask, causal=True)
    assert out.shape == (2, 100, 4, 32)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=1e-5, rtol=0)


def test_tokamax_on_an_old_tpu_says_why(monkeypatch):
    from hlotool.kernels.base import Features
    from hlotool.site import AttentionSite

    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    monkeypatch.setattr(jax, "devices", lambda: [types.SimpleNamespace(device_kind="TPU v4")])
    site = AttentionSite(batch=1, q_len=1024, kv_len=1024, num_q_heads=8, num_kv_heads=8,
                         head_dim=128, v_head_dim=128, dtype="float32", scale=0.1)
    kernel = tokamax_kernel.Tokamax("tpu")
    assert kernel._check(site, Features()) == kernels.Support.no(
        "TPU v4 attached; tokamax mosaic_tpu needs v5 or newer")


# --- packaging: the support range and a quiet CPU install --------------------------------


def _requirements() -> dict[str, str]:
    reqs = importlib.metadata.requires("hlotool") or []
    return {re.match(r"[A-Za-z0-9_.\-]+", r).group().lower(): r for r in reqs}


def test_libtpu_is_an_extra_so_a_cpu_install_stays_quiet():
    """libtpu, installed, makes every jax start in the user's own scripts print TPU warnings;
    a plain install leaves it out, and the test extra (deviceless TPU compiles) pulls it in."""
    reqs = _requirements()
    assert 'extra == "tpu"' in reqs["libtpu"]
    assert 'extra == "test"' in reqs["hlotool"] and "[tpu]" in reqs["hlotool"]
    assert "extra" not in reqs["jax"] and "extra" not in reqs["jaxlib"]


def test_tpu_target_without_libtpu_is_a_one_line_hint(monkeypatch):
    monkeypatch.setattr(targets, "_installed", lambda module: module != "libtpu")
    with pytest.raises(HlotoolError) as err:
        targets.get_target("tpu-v6e").sharding()
    assert str(err.value) == ('target tpu-v6e compiles deviceless through libtpu, which is not '
                              'installed: pip install "hlotool[tpu]"')
    assert targets.get_target("cpu").sharding() is None


def test_scan_groups_count_consts_carry_and_xs():
    """`num_consts`/`num_carry` up to jax 0.11, the groups of `ft_in` from 0.12: the
    installed jax's scan says which operands detection may read as constants of its body,
    and which are stacked per iteration."""
    def f(x, y, z):
        return jax.lax.scan(lambda c, w: (c * w + y * z[0], None), x, jnp.ones(3))[0]

    (scan,) = [e for e in jax.make_jaxpr(f)(1.0, 2.0, jnp.ones(2)).jaxpr.eqns
               if e.primitive.name == "scan"]
    assert jaxcompat.scan_groups(scan) == (2, 1, 1)


def test_shard_map_bodies_say_their_axes_on_this_jax():
    """`manual_axes` (`manual_axes` up to jax 0.9, `newly_manual_axes` from 0.10) and
    `varying_axes` (`aval.vma`, then `aval.manual_axis_type.varying`); `pvary` is the cast
    detection reads as a copy."""
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((1,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    body = jax.shard_map(lambda x, w: x * w, mesh=mesh, in_specs=(P("data"), P()),
                         out_specs=P("data"))
    (eqn,) = jax.make_jaxpr(body)(jnp.ones((2, 3)), jnp.ones(3)).jaxpr.eqns
    assert eqn.primitive.name == jaxcompat.SHARD_MAP
    assert jaxcompat.manual_axes(eqn) == {"data"}
    inner = eqn.params["jaxpr"]
    x, w = inner.invars
    assert (jaxcompat.varying_axes(x.aval), jaxcompat.varying_axes(w.aval)) == ({"data"}, set())
    assert any(e.primitive.name in jaxcompat.MANUAL_CASTS for e in inner.eqns)
    assert jaxcompat.varying_axes(jnp.ones(2)) == set()
