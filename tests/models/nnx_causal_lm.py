"""A 2-layer flax nnx causal LM whose mask is causal AND key padding (issue 36's case)."""
import sys

import jax.numpy as jnp
from flax import nnx


class LM(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, d: int = 32, heads: int = 4, layers: int = 2,
                 vocab: int = 64):
        self.embed = nnx.Embed(vocab, d, rngs=rngs)
        self.blocks = nnx.List([nnx.MultiHeadAttention(num_heads=heads, in_features=d, decode=False,
                                              rngs=rngs) for _ in range(layers)])
        self.out = nnx.Linear(d, vocab, rngs=rngs)

    def __call__(self, tokens, lengths):
        x = self.embed(tokens)
        padding = (jnp.arange(tokens.shape[1])[None, :] < lengths[:, None])[:, None, None, :]
        mask = nnx.combine_masks(nnx.make_causal_mask(tokens), padding)
        for block in self.blocks:
            x = x + block(x, mask=mask)
        return self.out(x)


@nnx.jit
def forward(model, tokens, lengths):
    return model(tokens, lengths)


L = int(sys.argv[1]) if len(sys.argv) > 1 else 2048
model = LM(nnx.Rngs(0))
print(forward(model, jnp.zeros((2, L), jnp.int32), jnp.array([L, L // 2])).shape)
