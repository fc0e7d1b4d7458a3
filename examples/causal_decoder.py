"""A small GPT-style decoder with hand-written causal attention, trained for a few steps.

Shapes (defaults in brackets; change them with the flags below):
  tokens  [B, L]            int32, B = --batch [2], L = --seq-len [64]
  x       [B, L, D]         D = --d-model [64]
  q, k, v [B, L, H, Dh]     H = --heads [4], Dh = D / H
  scores  [B, H, L, L]      q·kᵀ / √Dh, causal mask, softmax written out by hand
  logits  [B, L, V]         V = 256

Two jitted functions: `forward` (logits) and `train_step` (`jax.grad` of the next-token
loss, then SGD). Run it directly (``python examples/causal_decoder.py --seq-len 128``) or
under hlotool (``hlotool inspect examples/causal_decoder.py -- --seq-len 128``).
"""

from __future__ import annotations

import argparse
import functools
import math

import jax
import jax.numpy as jnp

VOCAB = 256

Params = dict[str, jax.Array | list[dict[str, jax.Array]]]


def init_params(key: jax.Array, d_model: int, layers: int) -> Params:
    """Embedding [V, D], per layer Wqkv [D, 3D], Wo [D, D], MLP [D, 4D] and [4D, D]."""
    keys = iter(jax.random.split(key, 1 + 4 * layers))

    def dense(shape: tuple[int, int]) -> jax.Array:
        return jax.random.normal(next(keys), shape) / math.sqrt(shape[0])

    blocks = [
        {
            "wqkv": dense((d_model, 3 * d_model)),
            "wo": dense((d_model, d_model)),
            "w1": dense((d_model, 4 * d_model)),
            "w2": dense((4 * d_model, d_model)),
        }
        for _ in range(layers)
    ]
    return {"embed": dense((VOCAB, d_model)), "blocks": blocks}


def layer_norm(x: jax.Array) -> jax.Array:
    mean = x.mean(-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(x.var(-1, keepdims=True) + 1e-5)


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """softmax(q·kᵀ/√Dh + causal) · v for q, k, v [B, L, H, Dh] → [B, L, H, Dh]."""
    length, head_dim = q.shape[1], q.shape[-1]
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(head_dim)
    causal = jnp.tril(jnp.ones((length, length), dtype=bool))
    scores = jnp.where(causal, scores, -1e9)
    scores = scores - scores.max(-1, keepdims=True)
    weights = jnp.exp(scores)
    weights = weights / weights.sum(-1, keepdims=True)
    return jnp.einsum("bhqk,bkhd->bqhd", weights, v)


def block(p: dict[str, jax.Array], x: jax.Array, heads: int) -> jax.Array:
    """One pre-norm decoder block on x [B, L, D]."""
    b, length, d = x.shape
    qkv = layer_norm(x) @ p["wqkv"]
    q, k, v = (t.reshape(b, length, heads, d // heads) for t in jnp.split(qkv, 3, axis=-1))
    x = x + causal_attention(q, k, v).reshape(b, length, d) @ p["wo"]
    return x + jax.nn.gelu(layer_norm(x) @ p["w1"]) @ p["w2"]


@functools.partial(jax.jit, static_argnames="heads")
def forward(params: Params, tokens: jax.Array, heads: int) -> jax.Array:
    """Logits [B, L, V] for tokens [B, L]."""
    x = params["embed"][tokens]
    for p in params["blocks"]:
        x = block(p, x, heads)
    return layer_norm(x) @ params["embed"].T


def loss_fn(params: Params, tokens: jax.Array, heads: int) -> jax.Array:
    """Mean next-token cross-entropy over tokens [B, L]."""
    logits = forward(params, tokens, heads)[:, :-1]
    targets = tokens[:, 1:]
    logp = jax.nn.log_softmax(logits)
    return -jnp.take_along_axis(logp, targets[..., None], axis=-1).mean()


@functools.partial(jax.jit, static_argnames="heads")
def train_step(params: Params, tokens: jax.Array, heads: int) -> tuple[Params, jax.Array]:
    """One SGD step; returns the new params and the loss before the step."""
    loss, grads = jax.value_and_grad(loss_fn)(params, tokens, heads)
    params = jax.tree.map(lambda w, g: w - 0.1 * g, params, grads)
    return params, loss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args()
    if args.d_model % args.heads:
        parser.error(f"--d-model {args.d_model} is not divisible by --heads {args.heads}")

    key = jax.random.key(0)
    params = init_params(key, args.d_model, args.layers)
    tokens = jax.random.randint(key, (args.batch, args.seq_len), 0, VOCAB)
    for step in range(args.steps):
        params, loss = train_step(params, tokens, args.heads)
        print(f"step {step}: loss {float(loss):.4f}")
    print("logits", forward(params, tokens, args.heads).shape)


if __name__ == "__main__":
    main()
