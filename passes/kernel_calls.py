"""Attention kernels a program already calls: hlotool's own, upstream Pallas, cuDNN, tokamax.

    calls = find_kernel_calls(parse_module(lowered.as_text(dialect="hlo", debug_info=True)))
    calls[0].kernel       # "pallas_tpu", "_flash_attention_kernel", "__cudnn$fmhaSoftmax", ...
    calls[0].library      # "hlotool" | "pallas" | "cudnn" | "tokamax"

Detection (`from_hlo`) finds naive softmax(Q·Kᵀ)·V; a program that already runs a flash kernel
has no such pattern left, only an opaque call. This HLO front end names those calls, in
pre-optimization HLO with debug info, from what each library leaves in the program:

  hlotool      its name scopes: the spliced call runs under ``hlotool/siteN:FILE:LINE`` and the
               kernel under its registry name (``…/pallas_tpu/…``, ``…/chunked/…``); the scope
               is read off the full op_name (pre-optimization HLO names ops relative to the
               `call` they sit in, so names are joined along the call chain).
  pallas       ``custom-call`` to ``tpu_custom_call`` (Mosaic TPU) or a Triton/Mosaic GPU
               target, whose kernel name is an attention kernel of jax's Pallas ops: from the
               op_name (``splash_mha_fwd_no_residuals/…/pallas_call``, ``mha_forward/pallas_
               call``), the Mosaic body (its func names; upstream ``flash_attention`` names no
               kernel otherwise) or the Python frames that made the call.
  cudnn        ``custom-call`` to ``__cudnn$fmha…`` (`jax.nn.dot_product_attention(
               implementation="cudnn")`).
  tokamax      the ``tokamax:{json}`` payload tokamax puts in each op's metadata (its bound
               arguments: the op's type and q/k/v shapes).

One entry per call; a kernel inside another library's wrapper (the Pallas call of a tokamax op
or of an hlotool site) is reported once, as the outer one.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import re
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Protocol

from hlotool.hlo import Computation, Instruction, Module, Shape, parse_module

LIBRARIES = ("hlotool", "pallas", "cudnn", "tokamax")

# hlotool.passes.replacement.scope(): "hlotool/site3:model.py:56".
SITE_SCOPE = re.compile(r"hlotool/site(\d+):([^/]*)")
# Attention kernels of jax's Pallas ops, by the name their pallas_call gives the kernel.
_PALLAS_ATTENTION = re.compile(
    r"^(?:_flash_attention_(?:kernel(?:_single_batch)?|dkv_kernel|dq_kernel)"  # tpu/flash_attention
    r"|splash_(?:mha|mqa)_(?:fwd|dq|dkv)\w*"  # tpu/splash_attention
    r"|mha_(?:forward|backward|preprocess_backward)"  # gpu/attention, gpu/decode_attention
    r"|paged_attention\w*|ragged_paged_attention\w*)$")  # tpu decode kernels
# Python files of jax's Pallas attention ops: a call made from one is an attention kernel
# even where neither its op_name nor its body names it.
_PALLAS_FILES = re.compile(
    r"pallas/ops/(?:tpu/(?:flash_attention|splash_attention/splash_attention_kernel|"
    r"paged_attention/\w+|ragged_paged_attention/\w+)|gpu/(?:attention|decode_attention))\.py$")
_PALLAS_TARGETS = ("tpu_custom_call", "__gpu$xla.gpu.triton", "triton_kernel_call_ffi",
                   "mosaic_gpu", "mosaic_gpu_v2")
_IDENTIFIER = re.compile(rb"[A-Za-z_][A-Za-z0-9_]{3,}")
_TOKAMAX = "tokamax:"
_FLOATS = ("f16", "bf16", "f32", "f64") + tuple(f"f8{s}" for s in (
    "e4m3fn", "e5m2", "e4m3fnuz", "e5m2fnuz", "e4m3b11fnuz", "e3m4", "e4m3", "e8m0fnu"))


@dataclasses.dataclass(frozen=True)
class KernelCall:
    """One attention kernel call a program makes.

    kernel: the kernel's own name (hlotool's registry name, the Pallas kernel's name, the
    cuDNN custom-call target, the tokamax op type). evidence: what in the HLO says so.
    operands/out: shapes of the call's array operands and of its result(s) as the HLO has
    them; q/k/v: those of the operands that are q, k and v where the calling convention is
    known (kernels take q, k, v as their first floating-point operands), else None.
    """

    function: str
    library: str
    kernel: str
    evidence: str
    source: str
    instruction: str
    operands: tuple[str, ...]
    out: tuple[str, ...]
    dtype: str
    q_shape: tuple[int, ...] | None = None
    k_shape: tuple[int, ...] | None = None
    v_shape: tuple[int, ...] | None = None
    site: str | None = None  # "hlotool/site1:model.py:56" for hlotool's own calls
    target: str = ""

    def describe(self) -> str:
        """`already a kernel: NAME (library)`, the line reports print."""
        return f"already a kernel: {self.kernel} ({self.library})"

    def shapes(self) -> str:
        """q k v shapes where known, else the operands → the result."""
        if self.q_shape is not None:
            return " ".join(_brackets(s) for s in (self.q_shape, self.k_shape, self.v_shape))
        return f"{', '.join(self.operands)} → {', '.join(self.out)}"

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        for key in ("q_shape", "k_shape", "v_shape", "operands", "out"):
            if out[key] is not None:
                out[key] = list(out[key])
        out["already_a_kernel"] = True
        return out


def _brackets(shape: Sequence[int] | None) -> str:
    return "?" if shape is None else "[" + ",".join(map(str, shape)) + "]"


def qualified_op_names(module: Module) -> dict[tuple[str, str], str]:
    """Every instruction's op_name in full, keyed by (computation, instruction) name.

    Pre-optimization HLO prints the op_name of an instruction inside a called computation
    relative to the `call` that runs it (`jit(f)/…/jit(hlotool_flash)` outside, `chunked/…`
    inside); the full name, the one the optimized program and a profile show, joins the
    names along the call chain. Loop bodies, branches and reducers continue their caller's
    prefix. A computation reached from several calls keeps the first prefix."""
    return _call_chain(module)[0]


def _call_chain(module: Module) -> tuple[dict[tuple[str, str], str], dict[str, str]]:
    """`qualified_op_names`, and per computation the user's source line of the nearest
    instruction up its call chain that has one (a kernel traced under a custom VJP keeps
    only the library's frames; the call around it still has the user's)."""
    prefix: dict[str, str] = {}
    names: dict[tuple[str, str], str] = {}
    sources: dict[str, str] = {}
    todo = [(module.entry.name, "", "")]
    while todo:
        name, here, source = todo.pop()
        if name in prefix or name not in module.computations:
            continue
        prefix[name], sources[name] = here, source
        for inst in module.computations[name].instructions:
            own = inst.metadata.get("op_name", "")
            full = f"{here}/{own}".strip("/") if own else here.rstrip("/")
            names[(name, inst.name)] = full
            inner = full if inst.opcode == "call" else here
            mine = _users_line(inst) or source
            todo.extend((c, inner, mine) for c in inst.called_computations)
    return names, sources


_LIBRARY = re.compile(r"[/\\](?:site|dist)-packages[/\\]")


def _users_line(inst: Instruction) -> str:
    """`file:line` of the innermost frame outside installed packages, or "" — unlike
    `hlotool.source.user_source`, which falls back to a library frame: here a caller up the
    chain may still have the user's line."""
    for frame in inst.stack:
        if not _LIBRARY.search(frame.file):
            return f"{frame.file}:{frame.line}"
    return ""


def _operand_shapes(comp: Computation, inst: Instruction) -> list[Shape]:
    shapes = []
    for i, operand in enumerate(inst.operands):
        printed = inst.operand_shapes[i] if i < len(inst.operand_shapes) else None
        if printed is None and operand in comp:
            printed = comp.get(operand).shape
        if printed is not None:
            shapes.append(printed)
    return shapes


def _leaves(shape: Shape) -> list[Shape]:
    return [leaf for s in shape.tuple_shapes for leaf in _leaves(s)] if shape.is_tuple \
        else [shape]


def _short(shape: Shape) -> str:
    return f"{shape.element_type}{_brackets(shape.dims)}"


def _qkv(shapes: Sequence[Shape]) -> tuple[tuple[int, ...], ...] | None:
    floats = [tuple(s.dims) for s in shapes if not s.is_tuple and s.element_type in _FLOATS
              and len(s.dims) >= 2]
    return tuple(floats[:3]) if len(floats) >= 3 else None


def _call(function: str, library: str, kernel: str, evidence: str, comp: Computation,
          inst: Instruction, source: str, qkv: tuple[tuple[int, ...], ...] | None = None,
          **extra: Any) -> KernelCall:
    operands = _operand_shapes(comp, inst)
    arrays = [leaf for s in operands for leaf in _leaves(s)]
    if qkv is None and library != "hlotool":
        qkv = _qkv(arrays)
    first = next((s for s in arrays if s.element_type in _FLOATS), None)
    dtype = _DTYPE_NAMES.get(first.element_type, first.element_type) if first else ""
    q, k, v = qkv if qkv is not None else (None, None, None)
    return KernelCall(function, library, kernel, evidence, source, inst.name, tuple(_short(s) for s in arrays),
                      tuple(_short(s) for s in _leaves(inst.shape)
                            if s.element_type not in ("u8", "token")),  # cuDNN's workspace
                      dtype, q, k, v, **extra)


_DTYPE_NAMES = {"f16": "float16", "bf16": "bfloat16", "f32": "float32", "f64": "float64"}


# ----------------------------------------------------------------------------------------
# Library by library


def _mosaic_kernel_names(inst: Instruction) -> list[str]:
    """Names in the Mosaic module a tpu_custom_call carries (MLIR text or bytecode: both
    keep symbol names as plain strings)."""
    config = inst.backend_config
    body = (config.get("custom_call_config", {}) or {}).get("body") \
        if isinstance(config, dict) else None
    if not isinstance(body, str):
        return []
    try:
        raw = base64.b64decode(body, validate=False)
    except ValueError:
        return []
    return list(dict.fromkeys(m.decode() for m in _IDENTIFIER.findall(raw)))


def _triton_kernel_name(inst: Instruction) -> str | None:
    raw = inst.attributes.get("backend_config", "")
    m = re.search(r'\bname\s*=\s*"([^"]+)"', raw) or re.search(r'"name":\s*"([^"]+)"', raw)
    return m.group(1) if m else None


def _pallas_kernel(inst: Instruction, full_op_name: str) -> tuple[str, str] | None:
    """(kernel name, evidence) of a Pallas custom call that is an attention kernel."""
    parts = full_op_name.split("/")
    # pallas_call(name=N) puts N on the name stack: "…/N/pallas_call".
    for part in reversed(parts[:-1] if parts[-1] == "pallas_call" else parts):
        if _PALLAS_ATTENTION.match(part):
            return part, f"{inst.custom_call_target} named {part} in its op_name"
    named = _triton_kernel_name(inst)
    if named and _PALLAS_ATTENTION.match(named):
        return named, f"{inst.custom_call_target} backend_config name {named}"
    for name in _mosaic_kernel_names(inst):
        if _PALLAS_ATTENTION.match(name):
            return name, f"tpu_custom_call whose Mosaic body defines {name}"
    for frame in inst.stack:
        if _PALLAS_FILES.search(frame.file.replace("\\", "/")):
            where = "/".join(frame.file.replace("\\", "/").split("/")[-3:])
            return (frame.function or "pallas_call"), \
                f"{inst.custom_call_target} called from {where}"
    return None


def _tokamax_payloads(inst: Instruction, full_op_name: str) -> list[str]:
    """The tokamax JSON payloads of an instruction, outermost first: newer tokamax writes
    them to `metadata_payload` (jax's set_xla_metadata), older ones into the op_name."""
    found = []
    for text in (inst.metadata.get("metadata_payload", ""), full_op_name,
                 inst.attributes.get("frontend_attributes", "")):
        pos = text.find(_TOKAMAX)
        while pos != -1:
            body = _balanced(text, pos + len(_TOKAMAX))
            if body is None:
                break
            found.append(body)
            pos = text.find(_TOKAMAX, pos + len(_TOKAMAX) + len(body))
    return list(dict.fromkeys(found))


def _balanced(text: str, start: int) -> str | None:
    """The {...} JSON object starting at `start` (braces inside strings ignored)."""
    if start >= len(text) or text[start] != "{":
        return None
    depth, in_string, escaped = 0, False, False
    for i in range(start, len(text)):
        c = text[i]
        if in_string:
            escaped = c == "\\" and not escaped
            if c == '"' and not escaped:
                in_string = False
            continue
        if c == '"':
            in_string = True
        elif c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return text[start:i + 1]
    return None


_SHAPE_TEXT = re.compile(r"^([a-z0-9_]+)\[([0-9, ]*)\]")


def _tokamax_attention(payload: str) -> tuple[str, dict[str, Any]] | None:
    """(op type name, arguments) of a tokamax payload that describes an attention op."""
    try:
        doc = json.loads(payload)
    except ValueError:
        return None
    op = doc.get("op") if isinstance(doc, dict) else None
    kind = op.get("__type", "") if isinstance(op, dict) else str(op or "")
    if "attention" not in kind.lower():
        return None
    args = doc.get("arguments")
    return kind.rsplit(".", 1)[-1], (args if isinstance(args, dict) else {})


def _shape_of(value: Any) -> tuple[int, ...] | None:
    """A tokamax argument "bf16[2,1024,8,128]{vmap_axes=…}" as its dims."""
    m = _SHAPE_TEXT.match(value) if isinstance(value, str) else None
    if m is None:
        return None
    return tuple(int(d) for d in m.group(2).replace(" ", "").split(",") if d)


# ----------------------------------------------------------------------------------------
# The pass


def find_kernel_calls(module: Module | str, function: str = "") -> list[KernelCall]:
    """Every attention kernel call in `module` (pre-optimization HLO with debug info, or its
    text), in program order."""
    if isinstance(module, str):
        module = parse_module(module)
    function = function or module.name
    names, caller_sources = _call_chain(module)
    from hlotool import kernels  # registry names: what hlotool's kernel scopes are called

    registry = set(kernels.names())
    found: list[tuple[int, KernelCall]] = []
    sites: dict[str, dict[str, Any]] = {}
    tokamax: dict[str, dict[str, Any]] = {}
    def source(comp: Computation, inst: Instruction) -> str:
        return _users_line(inst) or caller_sources.get(comp.name, "") or inst.source or ""

    for order, (comp, inst) in enumerate(_walk(module)):
        full = names.get((comp.name, inst.name), "")
        scope = SITE_SCOPE.search(full)
        if scope:
            entry = sites.setdefault(scope.group(0), {"order": order, "kernels": [],
                                                      "call": None, "qkv": None})
            tail = full[scope.end():].split("/")
            entry["kernels"] += [p for p in tail if p in registry and p not in entry["kernels"]]
            if inst.opcode == "call" and entry["call"] is None and \
                    full.endswith(scope.group(0) + "/jit(hlotool_flash)"):
                entry["call"] = (comp, inst)
            if inst.opcode == "custom-call" and entry["qkv"] is None and \
                    inst.custom_call_target in _PALLAS_TARGETS:  # the kernel's own call
                entry["qkv"] = _qkv([leaf for s in _operand_shapes(comp, inst)
                                     for leaf in _leaves(s)])
            continue
        payloads = [p for p in _tokamax_payloads(inst, full) if _tokamax_attention(p)]
        if payloads:
            entry = tokamax.setdefault(payloads[0], {"order": order, "at": None})
            # The call itself is the one instruction that is no data movement.
            if entry["at"] is None or (inst.opcode in ("custom-call", "fusion", "dot")
                                       and entry["at"][1].opcode not in ("custom-call",)):
                entry["at"] = (comp, inst)
            continue
        if inst.opcode != "custom-call":
            continue
        target = inst.custom_call_target or ""
        if target.startswith("__cudnn$fmha"):
            found.append((order, _call(function, "cudnn", target,
                                       f"custom_call_target {target}", comp, inst,
                                       source(comp, inst))))
        elif target in _PALLAS_TARGETS:
            named = _pallas_kernel(inst, full)
            if named is not None:
                found.append((order, _call(function, "pallas", named[0], named[1], comp, inst,
                                           source(comp, inst))))
    for scope_name, entry in sites.items():
        if not entry["kernels"] or entry["call"] is None:
            continue  # the site's naive equations on this platform: detection reports it
        comp, inst = entry["call"]
        found.append((entry["order"], _call(
            function, "hlotool", "+".join(entry["kernels"]),
            f"op_name scope {scope_name}/…/{entry['kernels'][0]}", comp, inst,
            _site_source(scope_name, source(comp, inst)), qkv=entry["qkv"], site=scope_name)))
    for payload, entry in tokamax.items():
        kind, args = _tokamax_attention(payload)
        comp, inst = entry["at"]
        qkv = tuple(_shape_of(args.get(n)) for n in ("q", "k", "v"))
        found.append((entry["order"], _call(
            function, "tokamax", kind, "tokamax: payload in the op's metadata", comp, inst,
            source(comp, inst), qkv=qkv if all(s is not None for s in qkv) else None)))
    return [call for _, call in sorted(found, key=lambda item: item[0])]


def _site_source(scope: str, call_source: str) -> str:
    """The site's own line (the scope names it, as inspect reported the naive site: its
    first line) in the full path of the spliced call, which carries the site's last line."""
    where = SITE_SCOPE.match(scope).group(2)
    path, _, _ = call_source.rpartition(":")
    file, _, line = where.rpartition(":")
    if path and file and path.replace("\\", "/").rsplit("/", 1)[-1] == file:
        return f"{path}:{line}"
    return call_source or where


def _walk(module: Module) -> Iterator[tuple[Computation, Instruction]]:
    """Instructions of the computations reachable from the entry, callees before the
    instruction that calls them (program order), each computation once."""
    seen: set[str] = set()

    def visit(name: str) -> Iterator[tuple[Computation, Instruction]]:
        if name in seen or name not in module.computations:
            return
        seen.add(name)
        comp = module.computations[name]
        for inst in comp.instructions:
            for callee in inst.called_computations:
                yield from visit(callee)
            yield comp, inst

    yield from visit(module.entry.name)


class _Captured(Protocol):
    name: str

    def hlo(self, debug_info: bool = True, target: str = "cpu") -> str: ...


def kernel_calls_captured(functions: Iterable[_Captured], target: str = "cpu"
                          ) -> list[KernelCall]:
    """The kernel calls of every captured function, from its pre-optimization HLO for
    `target` (a program that dispatches per platform calls another kernel on each)."""
    out = []
    for f in functions:
        out += [dataclasses.replace(c, target=target)
                for c in find_kernel_calls(f.hlo(debug_info=True, target=target), f.name)]
    return out
