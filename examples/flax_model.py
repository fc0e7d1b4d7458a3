"""A small flax.linen transformer language model built on `nn.MultiHeadDotProductAttention`.

Shapes (defaults in brackets; change them with the flags below):
  tokens  [B, L]            int32, B = --batch [2], L = --seq-len [64]
  x       [B, L, D]         D = --d-model [64]
  mask    [B, 1, L, L]      causal, from `nn.make_causal_mask`
  q, k, v [B, L, H, Dh]     inside flax's attention, H = --heads [4], Dh = D / H
  logits  [B, L, V]         V = 256

Two jitted functions: `predict` (``model.apply``) and `train_step` (`jax.grad` of the
next-token loss, then SGD). flax traces the attention flat into each jaxpr.
Run it directly (``python examples/flax_model.py --seq-len 128``) or under hlotool
(``hlotool inspect examples/flax_model.py -- --seq-len 128``).
"""

from __future__ import annotations

import argparse
import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

VOCAB = 256


class Block(nn.Module):
    """Pre-norm decoder block on x [B, L, D] with a causal mask [B, 1, L, L]."""

    heads: int

    @nn.compact
    def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:
        y = nn.MultiHeadDotProductAttention(num_heads=self.heads)(nn.LayerNorm()(x), mask=mask)
        x = x + y
        y = nn.Dense(4 * x.shape[-1])(nn.LayerNorm()(x))
        return x + nn.Dense(x.shape[-1])(nn.gelu(y))


class LanguageModel(nn.Module):
    """Token ids [B, L] → logits [B, L, V]."""

    d_model: int
    heads: int
    layers: int

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = nn.Embed(VOCAB, self.d_model)(tokens)
        mask = nn.make_causal_mask(tokens)
        for _ in range(self.layers):
            x = Block(self.heads)(x, mask)
        return nn.Dense(VOCAB)(nn.LayerNorm()(x))


@functools.partial(jax.jit, static_argnames="model")
def predict(model: LanguageModel, params: Any, tokens: jax.Array) -> jax.Array:
    """Logits [B, L, V] for tokens [B, L]."""
    return model.apply(params, tokens)


@functools.partial(jax.jit, static_argnames="model")
def train_step(model: LanguageModel, params: Any, tokens: jax.Array) -> tuple[Any, jax.Array]:
    """One SGD step on the next-token loss; returns new params and the loss before it."""

    def loss_fn(p: Any) -> jax.Array:
        logp = jax.nn.log_softmax(model.apply(p, tokens)[:, :-1])
        return -jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1).mean()

    loss, grads = jax.value_and_grad(loss_fn)(params)
    return jax.tree.map(lambda w, g: w - 0.1 * g, params, grads), loss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=1)
    args = parser.parse_args()
    if args.d_model % args.heads:
        parser.error(f"--d-model {args.d_model} is not divisible by --heads {args.heads}")

    model = LanguageModel(args.d_model, args.heads, args.layers)
    key = jax.random.key(0)
    tokens = jax.random.randint(key, (args.batch, args.seq_len), 0, VOCAB)
    params = jax.jit(model.init)(key, tokens)
    for step in range(args.steps):
        params, loss = train_step(model, params, tokens)
        print(f"step {step}: loss {float(loss):.4f}")
    print("logits", predict(model, params, tokens).shape)


if __name__ == "__main__":
    main()
