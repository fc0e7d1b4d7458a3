"""What the parser reads out of real fixtures and hand-written HLO: counts, called
computations, layouts, source lines, backend configs, and `inline_calls`."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from hlotool.errors import HlotoolError
from hlotool.hlo import Module, graphs_equal, parse_module, parse_shape, print_module, to_graph
from hlotool.hlo.graph import node_id

FIXTURES = Path(__file__).parent / "data" / "hlo"
FILES = sorted(p for p in FIXTURES.iterdir() if p.suffix in (".hlo", ".txt"))
GENERATOR = FIXTURES / "generate.py"


def load(name: str) -> Module:
    return parse_module((FIXTURES / name).read_text(), name)


def marked_line(tag: str) -> int:
    """Line number of `# fixture:<tag>` in the generator (where the op was written)."""
    for number, line in enumerate(GENERATOR.read_text().splitlines(), 1):
        if line.rstrip().endswith(f"# fixture:{tag}"):
            return number
    raise AssertionError(f"no '# fixture:{tag}' line in {GENERATOR}")


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_entry_instruction_count_matches_the_text(path: Path):
    # Independent count: lines of the ENTRY block that define a value.
    lines = path.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("ENTRY"))
    end = lines.index("}", start)
    expected = sum(1 for line in lines[start + 1 : end] if " = " in line)
    module = parse_module(path.read_text())
    assert len(module.entry.instructions) == expected
    assert module.entry.root.name == re.search(
        r"ROOT %?(\S+) =", "\n".join(lines[start:end])
    ).group(1)


def test_entry_parameters_and_signature():
    module = load("attention.cpu_post.hlo")
    params = module.entry.parameters
    assert [p.name for p in params] == ["q.1", "k.1", "v.1"]
    assert [p.parameter_number for p in params] == [0, 1, 2]
    assert all(p.shape.dims == (1, 16, 2, 8) and p.shape.element_type == "f32" for p in params)
    assert module.entry.signature.startswith("(q.1: f32[1,16,2,8]")
    assert module.attributes["is_scheduled"] == "true"
    assert module.entry.get("%q.1") is params[0]
    with pytest.raises(HlotoolError, match="no instruction 'nope'"):
        module.entry.get("nope")


def test_fusion_called_computations_are_found():
    module = load("attention.cpu_post.hlo")
    fusions = [i for i in module.entry.instructions if i.opcode == "fusion"]
    entry_text = (FIXTURES / "attention.cpu_post.hlo").read_text().split("\nENTRY")[1]
    assert len(fusions) == entry_text.count(" fusion(") > 0
    for fusion in fusions:
        (callee,) = fusion.called_computations
        body = module.computations[callee]
        assert str(body.root.shape) == str(fusion.shape)
        assert len(body.parameters) == len(fusion.operands)
    ynn = [f for f in fusions if f.attributes["kind"] == "kCustom"]
    assert len(ynn) == 2
    for fusion in ynn:
        assert fusion.backend_config["fusion_config"]["kind"] == "__ynn_fusion"
        assert module.computations[fusion.called_computations[0]].root.opcode == "dot"


def test_while_and_conditional_computations():
    loop = load("while.cpu_pre.hlo").entry.root
    assert loop.opcode == "while"
    assert loop.called_computations == ["region_1.3", "region_0.1"]  # condition, body
    cond = load("cond.cpu_pre.hlo").entry.root
    assert cond.opcode == "conditional"
    assert cond.called_computations == ["region_0.1", "region_1.2"]


def test_tiled_layouts_on_tpu():
    module = load("attention.tpu_post.hlo")
    tiled = [i.shape for i in module.instructions() if not i.shape.is_tuple and i.shape.tiles]
    assert tiled, "TPU post-optimization text has tiled layouts"
    q = module.entry.parameters[0].shape
    assert str(q) == "f32[1,16,2,8]{1,3,2,0:T(8,128)}"
    assert q.minor_to_major == (1, 3, 2, 0) and q.tiles == ((8, 128),)
    shape = parse_shape("bf16[8,128]{1,0:T(8,128)(2,1)}")
    assert shape.tiles == ((8, 128), (2, 1)) and shape.minor_to_major == (1, 0)
    assert shape.nbytes == 8 * 128 * 2
    assert parse_shape("s32[]{:T(128)}").minor_to_major == ()


def test_shapes_of_every_kind():
    nested = parse_shape("(f32[2]{0}, (s32[], token[]), /*index=2*/pred[3,4]{1,0})")
    assert nested.is_tuple and len(nested.tuple_shapes) == 3
    assert nested.tuple_shapes[1].tuple_shapes[1].element_type == "token"
    assert nested.nbytes == 2 * 4 + 4 + 0 + 12
    assert str(nested) == "(f32[2]{0}, (s32[], token[]), pred[3,4]{1,0})"
    assert parse_shape("f32[]").dims == () and parse_shape("f32[]").nbytes == 4
    assert parse_shape("s4[16]{0:E(4)}").nbytes == 8  # packed two per byte
    assert parse_shape("s4[16]{0}").nbytes == 16  # unpacked: one per byte
    assert parse_shape("f8e4m3fn[4,4]").nbytes == 16 and parse_shape("u8[3]").nbytes == 3
    dynamic = parse_shape("f32[<=10,4]{1,0}")
    assert dynamic.dims == (10, 4) and dynamic.dynamic == (True, False)
    assert str(dynamic) == "f32[<=10,4]{1,0}"


@pytest.mark.parametrize(
    ("fixture", "opcode"),
    [("attention.cpu_pre.hlo", "dot"), ("attention.tpu_post.hlo", "convolution")],
)
def test_source_of_attention_matmuls_is_the_generators_line(fixture: str, opcode: str):
    matmuls = [i for i in load(fixture).instructions() if i.opcode == opcode and i.metadata]
    assert len(matmuls) == 2
    expected = {marked_line("qk"), marked_line("pv")}
    found = set()
    for inst in matmuls:
        file, line = inst.source.rsplit(":", 1)
        assert file.endswith("tests/data/hlo/generate.py")
        assert inst.stack[0].function == "attention"
        # Outwards to the script's top level, through the generator's main().
        assert inst.stack[-1].function == "<module>"
        assert "main" in [f.function for f in inst.stack[1:-1]]
        found.add(int(line))
    assert found == expected


def test_source_inside_scan_body_and_user_source_skips_flax():
    (dot,) = [i for i in load("mlp_scan.cpu_pre.hlo").instructions() if i.opcode == "dot"]
    assert dot.source.endswith(f"generate.py:{marked_line('scan_dot')}")
    assert dot.stack[0].function == "mlp_scan.<locals>.layer"
    dots = [i for i in load("transformer.cpu_pre.hlo").instructions() if i.opcode == "dot"]
    assert dots and all("site-packages/flax/" in d.source for d in dots)
    assert all(d.user_source and "generate.py" in d.user_source for d in dots)


def test_backend_configs_sharding_and_custom_calls():
    (kernel,) = [i for i in load("flash.tpu_post.hlo").instructions() if i.opcode == "custom-call"]
    assert kernel.custom_call_target == "tpu_custom_call"
    assert "body" in kernel.backend_config["custom_call_config"]
    params = load("attention.sharded.tpu_pre.hlo").entry.parameters
    assert [p.attributes["sharding"] for p in params] == ["{devices=[1,4,1,1]<=[4]}"] * 3


HAND_WRITTEN = r"""HloModule hand, entry_computation_layout={(f32[2]{0})->f32[2]{0}}

%add_f32 (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %sum = f32[] add(f32[] %a, f32[] %b)
}

ENTRY %main (p: f32[2]) -> f32[2] {
  %p = f32[2]{0} parameter(0), metadata={op_name="jit(f)/a \"quoted\", {braces} (parens)"
    source_file="/x y.py" source_line=7}
  %table = f32[2,2]{1,0} constant({
    { 1, 2 },
    { 3, 4 }
  })
  %tok = token[] after-all()
  %cc = (f32[2]{0}, s32[]) custom-call(f32[2]{0} %p,
    token[] %tok), custom_call_target="my\"target", backend_config="{\"tile\": [8, 128]}"
  %opaque = f32[2]{0} custom-call(%p), custom_call_target="t", backend_config="not json"
  %gte = f32[2]{0} get-tuple-element(%cc), index=0
  %zero = f32[] constant(0)
  %r = f32[] reduce(%gte, %zero), dimensions={0}, to_apply=%add_f32
  %bc = f32[2]{0} broadcast(%r), dimensions={}
  %ds = f32[1]{0} dynamic-slice(%bc, %idx), dynamic_slice_sizes={1}
  %idx = s32[] constant(1)
  ROOT %out = f32[2]{0} add(%bc, %opaque), frontend_attributes={_xla_tag="a,b"}
}
"""


def test_hand_written_module_reads_everything():
    # Also: statements whose brackets stay open continue on the next line.
    module = parse_module(HAND_WRITTEN)
    entry = module.entry
    p = entry.get("p")
    assert p.metadata["op_name"] == 'jit(f)/a "quoted", {braces} (parens)'
    assert p.source == "/x y.py:7"
    table = entry.get("table")
    assert table.literal.split() == ["{", "{", "1,", "2", "},", "{", "3,", "4", "}", "}"]
    assert table.operands == []
    cc = entry.get("cc")
    assert cc.operands == ["p", "tok"]
    assert [str(s) for s in cc.operand_shapes] == ["f32[2]{0}", "token[]"]
    assert cc.shape.is_tuple and cc.custom_call_target == 'my"target'
    assert cc.backend_config == {"tile": [8, 128]}
    assert entry.get("opaque").backend_config == "not json"
    assert entry.get("r").dims("dimensions") == (0,)
    assert entry.get("bc").dims("dimensions") == ()
    assert entry.get("ds").dims("dynamic_slice_sizes") == (1,)
    with pytest.raises(HlotoolError, match="has no 'slice' attribute"):
        entry.get("ds").dims("slice")
    assert entry.get("r").called_computations == ["add_f32"]
    assert entry.get("out").attributes["frontend_attributes"] == '{_xla_tag="a,b"}'
    assert entry.root.name == "out" and entry.root.is_root
    again = parse_module(print_module(module))
    assert again.entry.get("p").metadata == p.metadata
    assert again.entry.get("table").literal == table.literal


def test_graph_nodes_edges_and_call_links():
    module = load("attention.cpu_post.hlo")
    graph = to_graph(module)
    assert graph.number_of_nodes() == sum(len(c) for c in module.computations.values())
    sub = node_id("main.5", "transpose_copy_fusion")
    assert graph.nodes[sub]["opcode"] == "fusion" and graph.nodes[sub]["is_root"]
    ynn = node_id("main.5", "ynn_fusion.1")
    operands = sorted(
        (d["index"], u) for u, _, d in graph.in_edges(ynn, data=True) if d["kind"] == "operand"
    )
    assert operands == [(0, "main.5/copy_bitcast_fusion.2"), (1, "main.5/copy_bitcast_fusion.1")]
    called = [
        (u, d["computation"]) for u, _, d in graph.in_edges(ynn, data=True) if d["kind"] == "called"
    ]
    assert called == [("fused_computation.1/dot.5", "fused_computation.1")]
    entry_only = to_graph(module, include_called=False)
    assert entry_only.number_of_nodes() == len(module.entry)
    assert all(d["kind"] == "operand" for *_, d in entry_only.edges(data=True))
    # A computation's graph pulls in what it calls, transitively.
    fused = to_graph(module.computations["fused_computation.4"])
    assert {d["computation"] for _, d in fused.nodes(data=True)} == {
        "fused_computation.4",
        "region_1.4",
    }


def _count_without_calls(module: Module, name: str) -> int:
    """Instructions a computation has once its calls are inlined (parameters of inlined
    bodies vanish; each call becomes its callee's body)."""
    total = 0
    for inst in module.computations[name].instructions:
        if inst.opcode == "call":
            total += _count_without_calls(module, inst.called_computations[0]) - len(
                module.computations[inst.called_computations[0]].parameters
            )
        else:
            total += 1
    return total


@pytest.mark.parametrize(
    "fixture", ["attention.cpu_pre.hlo", "mlp_scan.cpu_pre.hlo", "while.cpu_post.hlo"]
)
def test_inline_calls_replaces_every_call(fixture: str):
    module = load(fixture)
    calls = [i for i in module.instructions() if i.opcode == "call"]
    assert calls
    flat = module.inline_calls()
    assert not any(i.opcode == "call" for i in flat.instructions())
    for comp in flat.computations.values():
        assert len(comp) == _count_without_calls(module, comp.name)
        assert len({i.name for i in comp}) == len(comp)
        assert str(comp.root.shape) == str(module.computations[comp.name].root.shape)
    assert set(flat.computations) < set(module.computations)
    flat_graph = to_graph(flat)  # every operand names an instruction of its computation
    assert all("instruction" in d for _, d in flat_graph.nodes(data=True))
    # The original module is untouched, and the flat one survives a round trip.
    assert sum(1 for i in module.instructions() if i.opcode == "call") == len(calls)
    assert print_module(parse_module(print_module(flat))) == print_module(flat)


def test_inline_calls_wires_arguments_and_results():
    module = load("attention.cpu_pre.hlo")
    flat = module.inline_calls().entry
    assert "tril.1" not in module.inline_calls().computations
    # _where(mask, scores, fill) selects between the call's 2nd and 3rd arguments under the
    # broadcast of tril's result; users of the call now read the select.
    select = flat.get("select_n.3")
    assert select.opcode == "select"
    mask, on_true, on_false = (flat.get(n) for n in select.operands)
    assert on_true.name == "mul.3"
    assert mask.opcode == "broadcast" and flat.get(mask.operands[0]).name == "select_n.1"
    assert on_false.opcode == "broadcast" and on_false.operands == ["constant.13"]
    tril_root = flat.get("select_n.1")
    assert flat.get(tril_root.operands[1]).name == "broadcast_in_dim.9"  # tril's Arg_0
    assert flat.get("reduce_max.7").operands[0] == "select_n.3"
    assert flat.get("sub.7").operands == ["select_n.3", "sub.6"]


def test_crlf_line_endings_and_non_ascii_paths():
    text = (FIXTURES / "attention.cpu_pre.hlo").read_text()
    tables = text.replace('/tests/data/hlo/generate.py"', '/tests/données/生成.py"')
    assert tables != text
    crlf = tables.replace("\n", "\r\n")
    module, reference = parse_module(crlf), parse_module(text)
    assert graphs_equal(to_graph(module), to_graph(reference))
    dot = next(i for i in module.entry.instructions if i.opcode == "dot")  # the q·kᵀ one
    prefix = reference.entry.get(dot.name).source.rsplit("/tests/", 1)[0]
    assert dot.source == f"{prefix}/tests/données/生成.py:{marked_line('qk')}"
    assert parse_module(print_module(module)).entry.get(dot.name).source == dot.source


NESTED_CALLS = """HloModule nested

%identity (x: f32[2]) -> f32[2] {
  ROOT %x = f32[2]{0} parameter(0)
}

%double (y: f32[2]) -> f32[2] {
  %y = f32[2]{0} parameter(0)
  %same = f32[2]{0} call(%y), to_apply=%identity
  ROOT %twice = f32[2]{0} add(%same, %y)
}

ENTRY %main (p: f32[2]) -> f32[2] {
  %p = f32[2]{0} parameter(0)
  %a = f32[2]{0} call(%p), to_apply=%double
  %b = f32[2]{0} call(%a), to_apply=%double
  ROOT %out = f32[2]{0} call(%b), to_apply=%identity
}
"""


def test_inline_calls_nested_repeated_and_identity_bodies():
    flat = parse_module(NESTED_CALLS).inline_calls()
    assert list(flat.computations) == ["main"]
    entry = flat.entry
    # Each call of %double contributes its one add; %identity contributes nothing.
    assert [(i.name, i.opcode, i.operands) for i in entry.instructions] == [
        ("p", "parameter", []),
        ("twice", "add", ["p", "p"]),
        ("twice.1", "add", ["twice", "twice"]),
    ]
    assert entry.root.name == "twice.1"
    reparsed = parse_module(print_module(flat))
    assert [i.name for i in reparsed.entry.instructions] == ["p", "twice", "twice.1"]


def test_slices_windows_and_narrow_types():
    text = """HloModule narrow
ENTRY %main (a: s4[8], b: u8[4,4], c: f8e4m3fn[1,4,4,1]) -> (s4[2], f8e4m3fn[1,4,4,1]) {
  %a = s4[8]{0:E(4)} parameter(0)
  %b = u8[4,4]{1,0} parameter(1)
  %c = f8e4m3fn[1,4,4,1]{3,2,1,0} parameter(2)
  %s = s4[2]{0:E(4)} slice(%a), slice={[2:6:2]}
  %k = f8e4m3fn[3,3,1,1]{3,2,1,0} constant({...})
  %conv = f8e4m3fn[1,4,4,1]{3,2,1,0} convolution(%c, %k), window={size=3x3 pad=1_1x1_1}, \
dim_labels=b01f_01io->b01f
  ROOT %t = (s4[2]{0:E(4)}, f8e4m3fn[1,4,4,1]{3,2,1,0}) tuple(%s, %conv)
}
""".replace("\\\n", "")
    module = parse_module(text)
    entry = module.entry
    assert entry.get("s").attributes["slice"] == "{[2:6:2]}"
    assert entry.get("s").shape.nbytes == 1 and entry.get("a").shape.nbytes == 4
    assert entry.get("b").shape.nbytes == 16 and entry.get("c").shape.nbytes == 16
    conv = entry.get("conv")
    assert conv.attributes["window"] == "{size=3x3 pad=1_1x1_1}"
    assert conv.attributes["dim_labels"] == "b01f_01io->b01f"
    assert entry.get("k").literal == "{...}"
    assert [str(s) for s in entry.root.shape.tuple_shapes] == [
        "s4[2]{0:E(4)}",
        "f8e4m3fn[1,4,4,1]{3,2,1,0}",
    ]
    assert graphs_equal(to_graph(module), to_graph(parse_module(print_module(module))))
