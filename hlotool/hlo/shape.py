"""HLO shapes: `f32[2,3]{1,0}`, `bf16[8,128]{1,0:T(8,128)(2,1)}`, `(f32[], (s32[2], token[]))`."""

from __future__ import annotations

import dataclasses
import functools
import math
import re

# Bits each element occupies in memory. Sub-byte types are stored one per byte unless the
# layout packs them (`E(4)`), which is XLA's default on CPU.
_ELEMENT_BITS: dict[str, int] = {
    "pred": 8,
    "s2": 2,
    "s4": 4,
    "s8": 8,
    "s16": 16,
    "s32": 32,
    "s64": 64,
    "u2": 2,
    "u4": 4,
    "u8": 8,
    "u16": 16,
    "u32": 32,
    "u64": 64,
    "f4e2m1fn": 4,
    "f8e3m4": 8,
    "f8e4m3": 8,
    "f8e4m3fn": 8,
    "f8e4m3fnuz": 8,
    "f8e4m3b11fnuz": 8,
    "f8e5m2": 8,
    "f8e5m2fnuz": 8,
    "f8e8m0fnu": 8,
    "bf16": 16,
    "f16": 16,
    "f32": 32,
    "f64": 64,
    "c64": 64,
    "c128": 128,
    "token": 0,
    "opaque": 0,
}

_ARRAY_RE = re.compile(r"([a-z][a-z0-9]*)\[([^\]]*)\](?:\{([^{}]*)\})?")
_DIM_RE = re.compile(r"(<=)?(\d+|\?)")
_TILES_RE = re.compile(r"T((?:\([^)]*\))+)")
_TILE_RE = re.compile(r"\(([^)]*)\)")
_ELEMENT_SIZE_RE = re.compile(r"E\((\d+)\)")


class ShapeError(ValueError):
    """A shape string that is not HLO; `offset` is where in the string it went wrong."""

    def __init__(self, message: str, offset: int):
        super().__init__(message)
        self.offset = offset


@dataclasses.dataclass(frozen=True, slots=True)
class Shape:
    """An array shape (`element_type`, `dims`, `layout`) or a tuple of shapes.

    `dims` holds the (upper-bound) sizes; a `?` dimension is -1 and `<=N` sets its entry in
    `dynamic` to True. `layout` is the raw text between the braces (None when not printed).
    """

    element_type: str
    dims: tuple[int, ...] = ()
    layout: str | None = None
    tuple_shapes: tuple[Shape, ...] = ()
    dynamic: tuple[bool, ...] = ()

    @property
    def is_tuple(self) -> bool:
        return self.element_type == "tuple"

    @property
    def rank(self) -> int:
        return len(self.dims)

    @property
    def minor_to_major(self) -> tuple[int, ...] | None:
        """The layout's dimension order, minor first; None when no layout was printed."""
        if self.layout is None:
            return None
        order = self.layout.split(":", 1)[0].strip()
        return tuple(int(d) for d in order.split(",")) if order else ()

    @property
    def tiles(self) -> tuple[tuple[int, ...], ...]:
        """Layout tiles, e.g. `((8, 128), (2, 1))` for `{1,0:T(8,128)(2,1)}`."""
        if not self.layout or ":" not in self.layout:
            return ()
        tiles = _TILES_RE.search(self.layout.split(":", 1)[1])
        if tiles is None:
            return ()
        # `*` is XLA's "combine this dimension with the next" marker.
        return tuple(
            tuple(-1 if d.strip() == "*" else int(d) for d in t.split(","))
            for t in _TILE_RE.findall(tiles.group(1))
        )

    @property
    def num_elements(self) -> int:
        if self.is_tuple:
            raise ValueError(f"tuple shape {self} has no element count")
        return math.prod(self.dims)

    @property
    def nbytes(self) -> int:
        """Bytes of the array (sum over leaves for tuples), ignoring tile padding."""
        if self.is_tuple:
            return sum(s.nbytes for s in self.tuple_shapes)
        bits = _ELEMENT_BITS[self.element_type]
        packed = _ELEMENT_SIZE_RE.search(self.layout) if self.layout else None
        if packed:
            bits = int(packed.group(1))
        elif 0 < bits < 8:
            bits = 8
        return math.ceil(self.num_elements * bits / 8)

    def __str__(self) -> str:
        if self.is_tuple:
            return "(" + ", ".join(str(s) for s in self.tuple_shapes) + ")"
        dims = ",".join(
            ("?" if d < 0 else ("<=" if dyn else "") + str(d))
            for d, dyn in zip(self.dims, self.dynamic or (False,) * len(self.dims), strict=True)
        )
        layout = "" if self.layout is None else "{" + self.layout + "}"
        return f"{self.element_type}[{dims}]{layout}"


@functools.lru_cache(maxsize=65536)
def parse_shape(text: str) -> Shape:
    """Parses one HLO shape; raises `ShapeError` with the offset of the problem."""
    shape, end = _parse_at(text, _skip_ws(text, 0))
    end = _skip_ws(text, end)
    if end != len(text):
        raise ShapeError(f"unexpected {text[end]!r} after shape", end)
    return shape


def _skip_ws(text: str, pos: int) -> int:
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos


def _skip_comment(text: str, pos: int) -> int:
    # Long tuples print `/*index=5*/` before every fifth element.
    if text.startswith("/*", pos):
        end = text.find("*/", pos)
        if end < 0:
            raise ShapeError("unterminated '/*' comment", pos)
        pos = _skip_ws(text, end + 2)
    return pos


def _parse_at(text: str, pos: int) -> tuple[Shape, int]:
    if text.startswith("(", pos):
        elements: list[Shape] = []
        pos = _skip_comment(text, _skip_ws(text, pos + 1))
        if text.startswith(")", pos):
            return Shape("tuple"), pos + 1
        while True:
            element, pos = _parse_at(text, pos)
            elements.append(element)
            pos = _skip_ws(text, pos)
            if text.startswith(")", pos):
                return Shape("tuple", tuple_shapes=tuple(elements)), pos + 1
            if not text.startswith(",", pos):
                found = repr(text[pos]) if pos < len(text) else "end of text"
                raise ShapeError(f"expected ',' or ')' in tuple shape, found {found}", pos)
            pos = _skip_comment(text, _skip_ws(text, pos + 1))
    m = _ARRAY_RE.match(text, pos)
    if not m:
        raise ShapeError(
            f"expected a shape like f32[2,3]{{1,0}}, found {text[pos : pos + 12]!r}", pos
        )
    element_type, dims_text, layout = m.groups()
    if element_type not in _ELEMENT_BITS:
        raise ShapeError(f"unknown element type {element_type!r}", pos)
    dims: list[int] = []
    dynamic: list[bool] = []
    if dims_text.strip():
        for i, part in enumerate(dims_text.split(",")):
            d = _DIM_RE.fullmatch(part.strip())
            if not d:
                raise ShapeError(f"bad dimension {part.strip()!r} (#{i}) in {m.group(0)!r}", pos)
            dims.append(-1 if d.group(2) == "?" else int(d.group(2)))
            dynamic.append(d.group(1) is not None or d.group(2) == "?")
    return (
        Shape(element_type, tuple(dims), layout, (), tuple(dynamic) if any(dynamic) else ()),
        m.end(),
    )
