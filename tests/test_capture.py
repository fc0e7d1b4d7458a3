"""capture.py and targets.py: what gets recorded, the stages regenerated from it, errors."""

from __future__ import annotations

import os
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hlotool import capture, targets
from hlotool.capture import (
    NothingCapturedError,
    ScriptError,
    capture_function,
    capture_script,
    select,
)
from hlotool.errors import HlotoolError
from hlotool.targets import TARGETS, UnknownTargetError, default_jax_platforms, get_target


def sin_matmul(x: jax.Array) -> jax.Array:
    return jnp.sin(x) @ x.T


def write(tmp_path, name: str, source: str) -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(source))
    return str(path)


def test_capture_function_records_name_avals_and_timings():
    [f] = capture_function(jax.jit(sin_matmul), jnp.ones((4, 8)))
    assert (f.index, f.name) == (1, "sin_matmul")
    assert [(a.shape, a.dtype) for a in f.in_avals] == [((4, 8), np.float32)]
    assert f.args_summary() == ["f32[4,8]"]
    assert f.arg_names == ("x",)
    assert f.source is not None and f.source.endswith(f"{__file__}:{sin_matmul.__code__.co_firstlineno}")
    assert f.lower_seconds > 0 and f.compile_seconds is not None and f.compile_seconds > 0


def test_stages_regenerate_the_program():
    [f] = capture_function(jax.jit(sin_matmul), jnp.ones((4, 8)))
    assert "dot_general" in f.jaxpr_text and "sin" in f.jaxpr_text
    assert "stablehlo.dot_general" in f.stablehlo and "stablehlo.sine" in f.stablehlo
    assert f.hlo(debug_info=False).startswith("HloModule jit_sin_matmul")
    assert "metadata=" not in f.hlo(debug_info=False)
    assert "HloModule jit_sin_matmul" in f.optimized("cpu")
    # sin, transpose, dot_general; the HLO adds the parameter.
    assert f.instruction_counts() == {
        "jaxpr": 3,
        "stablehlo": 3,
        "hlo": 4,
        "optimized": capture._count_hlo(f.optimized()),
    }


def test_debug_hlo_points_at_user_source_lines():
    [f] = capture_function(jax.jit(sin_matmul), jnp.ones((4, 8)))
    text = f.hlo(debug_info=True)
    assert "metadata={op_name=" in text and "stack_frame_id=" in text
    assert f'"{__file__}"' in text.split("FileLocations")[0]  # FileNames table
    return_line = sin_matmul.__code__.co_firstlineno + 1
    assert f"line={return_line} " in text


def test_regenerated_program_computes_the_same_values():
    x = jnp.arange(32.0).reshape(4, 8) / 32
    [f] = capture_function(jax.jit(sin_matmul), x)
    [out] = f.compiled("cpu")(x)
    np.testing.assert_allclose(out, sin_matmul(x), rtol=1e-6)


def test_donation_is_captured_and_kept_in_regenerated_stages():
    def step(params, x):
        return params - 0.1 * x, x.sum()

    x = jnp.ones((4, 8))
    [f] = capture_function(jax.jit(step, donate_argnums=0), jnp.zeros((4, 8)), x)
    assert f.donated == (True, False)
    # The regenerated HLO aliases the donated input to the first output, as jax compiled it.
    assert "input_output_alias={ {0}: (0, {}, may-alias) }" in f.hlo(debug_info=False)
    assert "input_output_alias" in f.optimized("tpu-v5e")
    [g] = capture_function(jax.jit(step), x, x)
    assert g.donated == (False, False) and "input_output_alias" not in g.hlo(debug_info=False)


def test_with_jaxpr_gets_its_own_stages():
    x = jnp.ones((4, 8))
    [f] = capture_function(jax.jit(sin_matmul), x)
    assert "stablehlo.sine" in f.stablehlo and "sine" in f.optimized()
    g = f.with_jaxpr(jax.make_jaxpr(lambda x: jnp.cos(x) @ x.T)(x))
    assert (g.name, g.index, g.source) == (f.name, f.index, f.source)
    assert "stablehlo.cosine" in g.stablehlo and "cosine" in g.optimized()
    assert "cosine" not in f.optimized()  # the original's caches are untouched
    with pytest.raises(HlotoolError, match=r"sin_matmul: new program takes \(f32\[2\]\), "
                       r"expected \(f32\[4,8\]\)"):
        f.with_jaxpr(jax.make_jaxpr(jnp.sin)(jnp.ones(2)))


def test_eager_ops_and_library_jits_are_not_listed():
    def run(x):
        y = jnp.ones((4, 8)) + x * 2  # eager dispatch and jnp's own jitted helpers
        return jax.jit(sin_matmul)(y).sum()

    captured = capture_function(run, jnp.ones((4, 8)))
    assert [f.name for f in captured] == ["sin_matmul"]


def test_nested_jit_is_one_compile_and_recompiles_are_merged():
    inner = jax.jit(jnp.tanh)

    @jax.jit
    def outer(x):
        return inner(x) * 2

    def run():
        outer(jnp.ones(3))
        outer(jnp.zeros(3))  # same avals: served from cache
        outer(jnp.ones((2, 3)))  # new shape: a second compile

    captured = capture_function(run)
    assert [(f.index, f.name, f.args_summary()) for f in captured] == [
        (1, "outer", ["f32[3]"]),
        (2, "outer", ["f32[2,3]"]),
    ]


def test_functions_compiled_before_the_capture_are_captured_again():
    f = jax.jit(sin_matmul)
    f(jnp.ones((4, 8)))
    assert [c.name for c in capture_function(f, jnp.ones((4, 8)))] == ["sin_matmul"]


def test_lower_only_has_no_compile_time():
    [f] = capture_function(lambda: jax.jit(sin_matmul).lower(jnp.ones((2, 2))))
    assert f.compile_seconds is None and f.lower_seconds > 0


def test_nothing_compiled():
    with pytest.raises(NothingCapturedError, match="compiled no jax functions"):
        capture_function(lambda: jnp.ones(3) + 1)


def test_tpu_target_compiles_deviceless():
    [f] = capture_function(jax.jit(sin_matmul), jnp.ones((256, 128)))
    text = f.optimized("tpu-v5e")
    assert "T(8,128)" in text  # TPU tiled layout
    assert "T(8,128)" not in f.optimized("cpu")
    assert f.stage_filename("optimized", "tpu-v5e") == "001_jit_sin_matmul.tpu-v5e.optimized.hlo.txt"
    assert f.stage_filename("jaxpr", "tpu-v5e") == "001_jit_sin_matmul.jaxpr.txt"


@pytest.mark.parametrize(
    ("name", "kind"), [("tpu-v5e", "TPU v5 lite"), ("tpu-v5p", "TPU v5"), ("tpu-v6e", "TPU v6 lite"),
                       ("tpu-v5p-8", "TPU v5"), ("tpu-v6e-16", "TPU v6 lite")]
)
def test_tpu_targets_are_single_chip_topologies(name, kind):
    sharding = get_target(name).sharding()
    [device] = sharding.mesh.devices.flat
    assert device.device_kind == kind
    assert get_target(name).deviceless


def test_unknown_target_lists_valid_names():
    with pytest.raises(UnknownTargetError, match="unknown target 'tpu-v4'; valid targets: "
                       "cpu, tpu-v5e, tpu-v5p, tpu-v6e, tpu-v5p-8, tpu-v6e-16"):
        get_target("tpu-v4")
    assert get_target("cpu").sharding() is None and set(TARGETS) == {
        "cpu", "tpu-v5e", "tpu-v5p", "tpu-v6e", "tpu-v5p-8", "tpu-v6e-16"}
    assert [get_target(t).chips for t in TARGETS] == [1, 1, 1, 1, 8, 16]


@pytest.mark.parametrize(
    ("devices", "cuda_plugin", "expected"),
    [
        ({"/dev/accel0"}, False, None),  # a TPU is attached: let jax find it
        ({"/dev/vfio/0"}, False, None),
        (set(), False, "cpu"),
        ({"/dev/nvidia0"}, False, "cpu"),
        ({"/dev/nvidia0"}, True, "cuda,cpu"),
    ],
)
def test_default_jax_platforms(monkeypatch, devices, cuda_plugin, expected):
    monkeypatch.delenv("JAX_PLATFORMS")
    monkeypatch.setattr(os.path, "exists", lambda path: path in devices)
    monkeypatch.setattr(targets, "_installed", lambda module: cuda_plugin)
    default_jax_platforms()
    assert os.environ.get("JAX_PLATFORMS") == expected


def test_default_jax_platforms_respects_the_user(monkeypatch):
    monkeypatch.setenv("JAX_PLATFORMS", "tpu")
    default_jax_platforms()
    assert os.environ["JAX_PLATFORMS"] == "tpu"
    assert targets._installed("no_such_package.sub") is False
    assert targets._installed("jax.numpy") is True


SCRIPT = """\
import sys
import jax, jax.numpy as jnp
from helper import SCALE  # a module next to the script

@jax.jit
def scaled(x):
    return x * SCALE

def main():
    n = int(sys.argv[1])
    print("ran with", sys.argv[1:])
    scaled(jnp.ones((n, 2)))
    {tail}

if __name__ == "__main__":
    main()
"""


def test_capture_script_runs_as_main_with_argv_and_sibling_imports(tmp_path, capsys):
    write(tmp_path, "helper.py", "SCALE = 3\n")
    path = write(tmp_path, "model.py", SCRIPT.format(tail="sys.exit(0)"))
    argv_before, path_before = list(sys.argv), list(sys.path)
    [f] = capture_script(path, ["5"])
    assert (f.name, f.args_summary()) == ("scaled", ["f32[5,2]"])
    assert sys.argv == argv_before and sys.path == path_before
    out = capsys.readouterr()
    assert out.out == "" and "ran with ['5']" in out.err  # the script's stdout goes to stderr


@pytest.mark.parametrize(
    ("tail", "message"),
    [
        ("raise ValueError('bad\\nsecond line')", r"model.py:13: ValueError: bad$"),
        ("sys.exit(3)", r"model.py exited with status 3$"),
        ("sys.exit('giving up')", r"model.py exited with 'giving up'$"),
    ],
)
def test_capture_script_failures_are_one_line(tmp_path, tail, message):
    write(tmp_path, "helper.py", "SCALE = 3\n")
    path = write(tmp_path, "model.py", SCRIPT.format(tail=tail))
    with pytest.raises(ScriptError, match=message):
        capture_script(path, ["2"])


def test_capture_script_bad_files(tmp_path):
    with pytest.raises(ScriptError, match=r"^no such file: .*missing\.py$"):
        capture_script(tmp_path / "missing.py")
    with pytest.raises(ScriptError, match=r"^not a file: "):
        capture_script(tmp_path)
    broken = write(tmp_path, "broken.py", "import jax\ndef f(:\n    pass\n")
    with pytest.raises(ScriptError, match=r"broken\.py:2: syntax error: invalid syntax"):
        capture_script(broken)
    eager = write(tmp_path, "eager.py", "import jax.numpy as jnp\nprint(jnp.ones(3) + 1)\n")
    with pytest.raises(NothingCapturedError, match=r"eager\.py ran but compiled no jax functions"):
        capture_script(eager)


def test_select_by_glob_or_substring():
    def run():
        for fn in (jnp.sin, jnp.cos):
            jax.jit(lambda x, fn=fn: fn(x))(jnp.ones(2))

        @jax.jit
        def train_step(x):
            return x

        @jax.jit
        def eval_step(x):
            return x

        train_step(jnp.ones(2))
        eval_step(jnp.ones(2))

    captured = capture_function(run)
    assert [f.name for f in captured] == ["<lambda>", "<lambda>", "train_step", "eval_step"]
    assert captured[0].file_stem == "001_jit_lambda"
    assert [f.name for f in select(captured, "step")] == ["train_step", "eval_step"]
    assert [f.name for f in select(captured, "train_*")] == ["train_step"]
    assert [f.index for f in select(captured, "<*>")] == [1, 2]
    with pytest.raises(HlotoolError, match=r"no captured function matches 'step\*'; captured: "
                       r"<lambda>, eval_step, train_step"):
        select(captured, "step*")
