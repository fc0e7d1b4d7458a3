"""Profilers see the kernel and its site: every op of a rewritten site carries
`hlotool/siteN:FILE:LINE` and its kernel's name in its HLO `op_name` metadata — in the lowered
and the optimized program, on the host CPU (chunked) and on TPU (splash_tpu, compiled
deviceless and exported with jax.export). XProf, TensorBoard and `hlotool profile` read
exactly these names."""

from __future__ import annotations

import inspect
import math
import os
import re

import jax
import jax.numpy as jnp

import hlotool
from hlotool.hlo import parse_module
from hlotool.hlo.ir import split_names
from hlotool.passes.kernel_calls import qualified_op_names
from hlotool.targets import get_target

SHAPE = (1, 1024, 2, 64)  # long enough that auto picks a kernel on every platform


def causal_attention(q, k, v):
    length = q.shape[1]
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1])
    s = jnp.where(jnp.tril(jnp.ones((length, length), bool)), s, -1e9)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)


def _site_scope() -> str:
    """`hlotool/site1:test_profiler_names.py:LINE`, LINE being the site's first line (its
    QKᵀ einsum), found from the source so the test survives edits above it."""
    lines, first = inspect.getsourcelines(causal_attention)
    line = first + next(i for i, text in enumerate(lines) if "bqhd,bkhd->bhqk" in text)
    return f"hlotool/site1:{os.path.basename(__file__)}:{line}"


SCOPE = _site_scope()
CALL = "jit(hlotool_flash)"  # the spliced call; the calls inside it carry the scope too


def _op_names(hlo_text: str) -> list[str]:
    return [i.metadata["op_name"] for i in parse_module(hlo_text).instructions()
            if "op_name" in i.metadata]


def _called_op_names(hlo_text: str, scope: str) -> tuple[list[str], list[str]]:
    """The op_names of the calls carrying `scope`, and the full op_names (joined along the
    call chain: pre-optimization HLO names ops relative to their `call`) of the
    instructions in the computations they call."""
    module = parse_module(hlo_text)
    calls = [i for i in module.instructions() if i.opcode == "call" and scope in
             i.metadata.get("op_name", "") and i.metadata["op_name"].endswith(CALL)]
    inside, todo, seen = [], [c for call in calls for c in call.called_computations], set()
    full = qualified_op_names(module)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        for inst in module.computations[name].instructions:
            inside.append(full[(name, inst.name)])
            todo.extend(inst.called_computations)
    return [c.metadata["op_name"] for c in calls], inside


def _specs(sharding=None):
    return [jax.ShapeDtypeStruct(SHAPE, jnp.float32, sharding=sharding)] * 3


def test_cpu_lowered_hlo_names_the_site_and_the_chunked_kernel():
    lowered = hlotool.flash_jit(causal_attention).trace(*_specs()).lower()
    calls, inside = _called_op_names(lowered.as_text(dialect="hlo", debug_info=True), SCOPE)
    # One spliced call, named after the site, running the kernel jit hlotool traces.
    assert len(calls) == 1 and calls[0].endswith(f"/{SCOPE}/jit(hlotool_flash)"), calls
    assert any(f"/{SCOPE}/jit(hlotool_flash)/" in n and "/chunked/" in n for n in inside), \
        sorted(set(inside))[:10]


def test_every_op_the_site_calls_carries_its_scope_on_its_own():
    """Each instruction in the computations the site's call reaches names the site in its
    own op_name, not only once joined with its callers' (issue 37: the kernel's
    `chunked/while` ops had only their own names, so a profile could not place them)."""
    text = hlotool.flash_jit(causal_attention, kernel="chunked").trace(
        *_specs()).lower().as_text(dialect="hlo", debug_info=True)
    module = parse_module(text)
    combiners = {name for i in module.instructions() if i.opcode != "call"
                 for name in split_names(i.attributes.get("to_apply", ""))}
    calls = [i for i in module.instructions() if i.opcode == "call" and SCOPE in
             i.metadata.get("op_name", "") and i.metadata["op_name"].endswith(CALL)]
    todo, seen, unnamed = [c for call in calls for c in call.called_computations], set(), []
    while todo:
        name = todo.pop()
        if name in seen or name in combiners:
            continue
        seen.add(name)
        for inst in module.computations[name].instructions:
            todo.extend(inst.called_computations)
            op_name = inst.metadata.get("op_name")
            # A bare primitive name is jax's own lowering of one primitive as a function
            # (cumsum's reduce-window), which names its ops afresh.
            if op_name is not None and "/" in op_name and SCOPE not in op_name:
                unnamed.append(op_name)
    assert len(seen) > 3 and not unnamed, sorted(set(unnamed))[:10]


def _profiled_op_names(hlo_text: str) -> list[str]:
    """The op_names of the instructions a profiler shows: all but those of the scalar
    combiners a reduce, scatter or sort applies (XLA keeps the combiner's own metadata
    there, which from jax 0.12 on is relative to a `cond` branch; no trace event has it)."""
    module = parse_module(hlo_text)
    combiners = {name for i in module.instructions() if i.opcode != "call"
                 for name in split_names(i.attributes.get("to_apply", ""))}
    return [i.metadata["op_name"] for name, comp in module.computations.items()
            if name not in combiners for i in comp.instructions if "op_name" in i.metadata]


def test_cpu_optimized_hlo_names_the_site_and_the_chunked_kernel():
    compiled = hlotool.flash_jit(causal_attention).trace(*_specs()).lower().compile()
    names = _profiled_op_names(compiled.as_text())
    kernel_ops = [n for n in names if f"/{SCOPE}/jit(hlotool_flash)/" in n and "/chunked/" in n]
    assert kernel_ops, [n for n in names if "hlotool" in n][:10]
    # No op of the kernel escapes its site's scope.
    assert all(SCOPE in n for n in names if "/chunked/" in n), sorted(
        n for n in names if "/chunked/" in n and SCOPE not in n)


def _tpu_compiled():
    sharding = get_target("tpu-v5e").sharding()
    fast = hlotool.flash_jit(causal_attention, in_shardings=sharding, out_shardings=sharding)
    return fast.trace(*_specs(sharding)).lower()


def _tpu_custom_calls(hlo_text: str) -> list:
    return [i for i in parse_module(hlo_text).instructions()
            if i.opcode == "custom-call" and i.custom_call_target == "tpu_custom_call"]


def test_tpu_lowered_hlo_names_the_site_and_splash_tpu():
    text = _tpu_compiled().as_text(dialect="hlo", debug_info=True)
    calls, inside = _called_op_names(text, SCOPE)
    assert len(calls) == 1 and calls[0].endswith(f"/{SCOPE}/jit(hlotool_flash)"), calls
    (kernel,) = _tpu_custom_calls(text)  # the Pallas kernel, forward only
    (full,) = [n for (_, name), n in qualified_op_names(parse_module(text)).items()
               if name == kernel.name]
    assert full in inside
    assert re.search(rf"/{re.escape(SCOPE)}/jit\(hlotool_flash\)/(.*/)?splash_tpu/"
                     r"(.*/)?pallas_call$", full), full


def test_tpu_optimized_hlo_names_the_site_and_splash_tpu():
    text = _tpu_compiled().compile().as_text()
    (kernel,) = _tpu_custom_calls(text)
    op_name = kernel.metadata["op_name"]
    # The full path a TPU profile shows for the Mosaic kernel's op.
    assert re.fullmatch(rf"jit\(causal_attention\)/.*{re.escape(SCOPE)}/jit\(hlotool_flash\)/"
                        r"(.*/)?splash_tpu/(.*/)?pallas_call", op_name), op_name


def test_tpu_export_locations_name_the_site_and_splash_tpu():
    exported = jax.export.export(hlotool.flash_jit(causal_attention), platforms=["tpu"])(
        *_specs())
    mlir = exported.mlir_module()
    (call,) = [i for i, ln in enumerate(mlir.splitlines())
               if "stablehlo.custom_call @tpu_custom_call" in ln]
    # StableHLO, like HLO, names ops relative to the func.call that runs them: collect the
    # location names of every call on the chain from main down to the kernel's function.
    names = _call_chain_names(mlir, call)
    assert any(n.endswith(f"{SCOPE}/jit(hlotool_flash)") for n in names), names
    assert any(re.search(r"(^|/)splash_tpu(/|$)", n) for n in names), names


def _call_chain_names(mlir: str, line_no: int) -> list[str]:
    """Quoted names in the locations of the func.calls leading to the function that holds
    line `line_no`, innermost first."""
    lines = mlir.splitlines()
    table = dict(re.findall(r"^(#loc\d+) = loc\((.*)\)$", mlir, re.M))

    def loc_names(ref: str) -> list[str]:
        out, todo, seen = [], [ref], set()
        while todo:
            r = todo.pop()
            if r in seen or r not in table:
                continue
            seen.add(r)
            out += re.findall(r'"([^"]*)"', table[r])
            todo += re.findall(r"#loc\d+", table[r])
        return out

    names, todo, seen = [], [line_no], set()
    while todo:
        at = todo.pop()
        func = next((re.search(r"func\.func (?:private |public )?@([\w.$-]+)", lines[i]).group(1)
                     for i in range(at, -1, -1) if "func.func" in lines[i]), "main")
        if func in seen or func == "main":
            continue
        seen.add(func)
        for i, ln in enumerate(lines):
            if re.search(rf"call @{re.escape(func)}\(", ln):
                ref = re.search(r"loc\((#loc\d+)\)\s*$", ln)
                names += loc_names(ref.group(1)) if ref else []
                todo.append(i)
    return names
