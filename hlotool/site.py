"""`AttentionSite`: the contract between detection (passes/), kernels (kernels/) and reports.

Detection describes each naive ``softmax(Q·Kᵀ·scale + mask)·V`` it finds as one
`AttentionSite`; kernels decide from it whether they can take the site, and cost models
price it. It is plain data so that it serializes to the versioned JSON report as is.

Canonical terms (what kernels take), whatever layout the program used:
  q: [B, Lq, Hq, D]    k: [B, Lk, Hkv, D]    v: [B, Lk, Hkv, Dv]    out: [B, Lq, Hq, Dv]
Hq is a multiple of Hkv (Hq == Hkv: multi-head; Hkv == 1: MQA; otherwise GQA).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Literal

import numpy as np

# "local": a sliding window alone (`window`); with a causal, boolean or additive mask the
# window is reported beside that kind.
MaskKind = Literal["none", "causal", "local", "additive", "boolean"]
MASK_KINDS: tuple[str, ...] = ("none", "causal", "local", "additive", "boolean")


Band = tuple[int | None, int | None]
# At most this many query rows against a cache 16 times longer make a decode step (one
# token, or a few a speculative decoder verifies at once).
DECODE_ROWS = 8
CAUSAL: Band = (None, 0)  # the band of a causal mask: keys up to the query's own position


def band_of(causal: bool, window: Band | None) -> Band | None:
    """The (left, right) band a causal mask and a window leave visible together (query i sees
    keys i - left .. i + right, None for an unbounded side); None for all keys."""
    left, right = window if window is not None else (None, None)
    if causal:
        right = 0 if right is None else min(right, 0)
    return None if (left, right) == (None, None) else (left, right)


@dataclasses.dataclass(frozen=True)
class AttentionSite:
    """One naive attention in a program, in canonical [B, L, H, D] terms."""

    batch: int
    q_len: int
    kv_len: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    v_head_dim: int
    # The dtype the attention's two dots compute in, e.g. "float32", "bfloat16": q/k/v's
    # own, or what the program promotes them to (a bfloat16 q against float32 k and v, or
    # float32 probabilities against a bfloat16 v, compute in float32). Kernels take it.
    dtype: str
    scale: float | None  # multiplier of the scores (q/√d → 1/√d); None when unscaled
    mask: MaskKind = "none"
    # The mask hides every key after the query's own position: `mask` "causal" alone, or a
    # causal factor ANDed with the boolean or additive operand `mask` names (causal & key
    # padding). Set from `mask` == "causal" when not given.
    causal: bool = False
    # Shape of the mask/bias operand as broadcast against the [.., Lq, Lk] scores, in the
    # program's own layout; None when there is no operand (e.g. an iota-built causal mask).
    mask_shape: tuple[int, ...] | None = None
    # The logit a hidden key has at the softmax: the mask's fill after every scale step that
    # follows it, in the program's dtypes (-inf: hidden outright). None without a mask.
    mask_fill: float | None = None
    # Shape of a factor the probabilities are multiplied by, constant along the keys (a head
    # mask), as broadcast against them; None without one (an all-ones head mask is none).
    multiplier_shape: tuple[int, ...] | None = None
    # The canonical axes, of "BHQK" (batch, heads, queries, keys), along which the mask and
    # bias operands vary: "BK" for key padding, "QK" for a mask shared by the batch and heads.
    # None without an operand (an iota-built causal mask has none).
    mask_axes: str | None = None
    # Logit soft-capping c·tanh(x / c) between the scale and the masks (Gemma 2): c, or None.
    softcap: float | None = None
    # `where(mask, softmax(...), 0)` after the softmax (Keras' masked softmax), its mask not
    # drawn from random bits.
    post_mask: bool = False
    # Dropout on the probabilities, keep a mask drawn from random bits: `softmax(...) *
    # (keep / keep_prob)` (flax, HF) or `where(keep, softmax(...) / keep_prob, 0)` (Keras).
    dropout: bool = False
    # A constant the probabilities are multiplied by after the softmax, which the output
    # takes instead (Keras' dropout: `where(keep, p / keep_prob, 0)`); None without one.
    out_scale: float | None = None
    # An extra logit per row in the softmax, with no value (attention sinks, GPT-OSS).
    sinks: bool = False
    # A sliding window read from the mask's structure: query i sees keys i - left .. i +
    # right, None for an unbounded side; None without one.
    window: tuple[int | None, int | None] | None = None
    # A factor q_ids[b, i] == kv_ids[b, j] of the mask (packed sequences), read as segment ids.
    segments: bool = False
    # A boolean factor of the mask varying along batch and queries only ([B, 1, Lq, 1]: query
    # padding, as flax's `make_attention_mask(pad, pad)` ANDs beside the key padding), kept
    # apart from the operand `mask` and `mask_axes` describe.
    query_padding: bool = False
    # The band (`causal`, `window`) is read from positions the program computes at run time,
    # as if each were its index (the `gemma` library's sliding window, `cumsum(input_mask) -
    # 1`): true for left padding or none, not for right padding. A rewrite checks per call
    # that the program's mask equals the reading, and runs the site with its own dense mask
    # where it does not.
    band_from_positions: bool = False
    # The program's own operand shapes and the layout they map from ("BLHD", "BHLD", "LHD", ...).
    q_shape: tuple[int, ...] = ()
    k_shape: tuple[int, ...] = ()
    v_shape: tuple[int, ...] = ()
    layout: str = "BLHD"
    # Dtype the softmax is computed in (an f32 upcast inside a bf16 model shows here).
    softmax_dtype: str | None = None
    function: str = ""  # captured function the site lives in
    source: str = ""  # "path:line" in the user's code

    def __post_init__(self) -> None:
        if self.mask not in MASK_KINDS:
            raise ValueError(f"mask must be one of {MASK_KINDS}, got {self.mask!r}")
        if self.mask == "causal":
            object.__setattr__(self, "causal", True)
        elif self.causal and self.mask in ("none", "local"):
            object.__setattr__(self, "mask", "causal")
        if self.num_kv_heads <= 0 or self.num_q_heads % self.num_kv_heads:
            raise ValueError(
                f"query heads ({self.num_q_heads}) must be a multiple of key/value heads "
                f"({self.num_kv_heads})"
            )

    @property
    def decode(self) -> bool:
        """A decode step: a few query rows (one per generated token) against a longer key
        cache; it reads K and V once and writes no L×L buffer."""
        return self.q_len <= DECODE_ROWS and self.kv_len >= 16 * self.q_len

    @property
    def variants(self) -> tuple[str, ...]:
        """The softmax variants the site uses, as reports name them (and "decode step")."""
        out = ["decode step"] if self.decode else []
        if self.window is not None:
            left, right = ("∞" if w is None else str(w) for w in self.window)
            out.append(f"window ({left}, {right})")
        if self.band_from_positions:
            out.append("band from positions, checked per call")
        if self.segments:
            out.append("segment ids")
        if self.softcap is not None:
            out.append(f"softcap {self.softcap:g}")
        if self.sinks:
            out.append("sinks")
        if self.post_mask:
            out.append("post-softmax mask")
        if self.dropout:
            out.append("dropout")
        if self.out_scale is not None:
            out.append(f"output scale {self.out_scale:g}")
        if self.multiplier_shape is not None:
            out.append("head mask")
        return tuple(out)

    @property
    def mask_factors(self) -> tuple[str, ...]:
        """The mask as the AND of factors reports name: "causal", "query padding", then the
        operand as "key padding" ([B, 1, 1, Lk]: varies along batch and keys only), "query
        padding", or its kind; the window and segment ids are among `variants`."""
        out = ["causal"] if self.causal else []
        if self.query_padding:
            out.append("query padding")
        if self.mask in ("boolean", "additive"):
            along = set(self.mask_axes or "")
            if self.mask == "boolean" and "K" in along and along <= {"B", "K"}:
                out.append("key padding")
            elif self.mask == "boolean" and "Q" in along and along <= {"B", "Q"}:
                if not self.query_padding:
                    out.append("query padding")
            else:
                out.append(self.mask)
        return tuple(out)

    @property
    def mask_text(self) -> str:
        """`mask_factors` joined by " & " ("causal & key padding"), or the mask kind."""
        return " & ".join(self.mask_factors) or self.mask

    @property
    def band(self) -> Band | None:
        """(left, right) of the keys each query sees by structure (causal: (None, 0), with
        the window intersected), None when that is all of them."""
        return band_of(self.causal, self.window)

    @property
    def itemsize(self) -> int:
        return np.dtype(self.dtype).itemsize

    @property
    def score_bytes(self) -> int:
        """Bytes of one [B, Hq, Lq, Lk] score matrix the naive program materializes."""
        dtype = self.softmax_dtype or self.dtype
        return (
            self.batch * self.num_q_heads * self.q_len * self.kv_len * np.dtype(dtype).itemsize
        )

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> AttentionSite:
        """The site a `to_json` object describes (its derived fields dropped)."""
        names = {f.name for f in dataclasses.fields(cls)}
        fields = {k: v for k, v in doc.items() if k in names}
        for key in ("q_shape", "k_shape", "v_shape", "mask_shape", "multiplier_shape", "window"):
            if fields.get(key) is not None:
                fields[key] = tuple(fields[key])
        if isinstance(fields.get("mask_fill"), str):
            fields["mask_fill"] = float(fields["mask_fill"])
        return cls(**fields)

    def to_json(self) -> dict[str, Any]:
        """The site as the versioned report's JSON object."""
        out = dataclasses.asdict(self)
        for key in ("q_shape", "k_shape", "v_shape", "mask_shape", "multiplier_shape", "window"):
            if out[key] is not None:
                out[key] = list(out[key])
        out["score_bytes"] = self.score_bytes
        if out["mask_fill"] is not None and not math.isfinite(out["mask_fill"]):
            out["mask_fill"] = str(out["mask_fill"])  # "-inf": JSON has no infinities
        return out
