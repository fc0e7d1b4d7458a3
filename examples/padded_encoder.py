"""A small transformer encoder over padded sequences: key-padding mask from lengths.

Shapes (defaults in brackets; change them with the flags below):
  x        [B, L, D]        B = --batch [2], L = --seq-len [64], D = --d-model [64]
  lengths  [B]              int32, valid tokens per sequence (the rest is padding)
  q, k, v  [B, H, L, Dh]    H = --heads [4], Dh = D / H (heads-first layout)
  mask     [B, 1, 1, L]     bool, True where the key is a real token
  scores   [B, H, L, L]     q·kᵀ · Dh^-½, masked with jnp.where, then `jax.nn.softmax`
  pooled   [B, D]           mean of the valid positions

One jitted function, `encode`. ``--dtype bfloat16`` runs the whole model in bf16.
Run it directly (``python examples/padded_encoder.py --seq-len 128``) or under hlotool
(``hlotool inspect examples/padded_encoder.py -- --seq-len 128``).
"""

from __future__ import annotations

import argparse
import functools
import math

import jax
import jax.numpy as jnp

Params = list[dict[str, jax.Array]]


def init_params(key: jax.Array, d_model: int, layers: int, dtype: jnp.dtype) -> Params:
    """Per layer Wq, Wk, Wv, Wo [D, D] and MLP [D, 2D], [2D, D]."""
    shapes = {"wq": (1, 1), "wk": (1, 1), "wv": (1, 1), "wo": (1, 1), "w1": (1, 2), "w2": (2, 1)}
    params = []
    for layer_key in jax.random.split(key, layers):
        keys = jax.random.split(layer_key, len(shapes))
        params.append(
            {
                name: (
                    jax.random.normal(k, (m * d_model, n * d_model)) / math.sqrt(m * d_model)
                ).astype(dtype)
                for k, (name, (m, n)) in zip(keys, shapes.items())
            }
        )
    return params


def padded_attention(q: jax.Array, k: jax.Array, v: jax.Array, lengths: jax.Array) -> jax.Array:
    """softmax(q·kᵀ·Dh^-½ where key < length) · v; q, k, v [B, H, L, Dh], lengths [B]."""
    scores = jnp.einsum("bhqd,bhkd->bhqk", q, k) * q.shape[-1] ** -0.5
    key_valid = jnp.arange(k.shape[2])[None, :] < lengths[:, None]  # [B, L]
    scores = jnp.where(key_valid[:, None, None, :], scores, jnp.finfo(scores.dtype).min)
    return jax.nn.softmax(scores, axis=-1) @ v


def layer(p: dict[str, jax.Array], x: jax.Array, lengths: jax.Array, heads: int) -> jax.Array:
    """One post-norm encoder layer on x [B, L, D]."""
    b, length, d = x.shape

    def split_heads(t: jax.Array) -> jax.Array:  # [B, L, D] -> [B, H, L, Dh]
        return t.reshape(b, length, heads, d // heads).transpose(0, 2, 1, 3)

    q, k, v = (split_heads(x @ p[w]) for w in ("wq", "wk", "wv"))
    attended = padded_attention(q, k, v, lengths).transpose(0, 2, 1, 3).reshape(b, length, d)
    x = jax.nn.standardize(x + attended @ p["wo"], axis=-1)
    return jax.nn.standardize(x + jax.nn.relu(x @ p["w1"]) @ p["w2"], axis=-1)


@functools.partial(jax.jit, static_argnames="heads")
def encode(params: Params, x: jax.Array, lengths: jax.Array, heads: int) -> jax.Array:
    """Pooled encodings [B, D] of x [B, L, D] whose first lengths[b] positions are real."""
    for p in params:
        x = layer(p, x, lengths, heads)
    valid = (jnp.arange(x.shape[1])[None, :] < lengths[:, None]).astype(x.dtype)
    return (x * valid[..., None]).sum(1) / lengths[:, None].astype(x.dtype)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    args = parser.parse_args()
    if args.d_model % args.heads:
        parser.error(f"--d-model {args.d_model} is not divisible by --heads {args.heads}")

    key_params, key_x = jax.random.split(jax.random.key(0))
    dtype = jnp.dtype(args.dtype)
    params = init_params(key_params, args.d_model, args.layers, dtype)
    x = jax.random.normal(key_x, (args.batch, args.seq_len, args.d_model)).astype(dtype)
    # Sequence b keeps its first L - b·L/(2B) positions: every batch row is padded differently.
    lengths = args.seq_len - jnp.arange(args.batch) * (args.seq_len // (2 * args.batch))
    pooled = encode(params, x, lengths, args.heads)
    print("lengths", lengths.tolist(), "pooled", pooled.shape, pooled.dtype)


if __name__ == "__main__":
    main()
