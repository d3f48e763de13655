"""A Flax model written without meshtrain in mind, sharded by meshtrain's rules and trained by its step.

The model is plain flax NNX (nnx.Embed, nnx.MultiHeadAttention, nnx.Linear,
nnx.LayerNorm) with no logical names. meshtrain names its weights by path
(`meshtrain.FLAX_TRANSFORMER`), places them for `fsdp` x `tensor`, and trains
it on real text, byte-level: any UTF-8 text file.

  python examples/flax_model.py TEXT_FILE   # 8 simulated CPU devices: fsdp=4 x tensor=2
"""

import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import meshtrain  # noqa: E402

# ---- the user's model, as the Flax docs would write it ----------------------

class Block(nnx.Module):

  def __init__(self, dim: int, heads: int, hidden: int, *, rngs: nnx.Rngs):
    self.norm1 = nnx.LayerNorm(dim, rngs=rngs)
    self.attn = nnx.MultiHeadAttention(num_heads=heads, in_features=dim, decode=False, rngs=rngs)
    self.norm2 = nnx.LayerNorm(dim, rngs=rngs)
    self.up = nnx.Linear(dim, hidden, rngs=rngs)
    self.down = nnx.Linear(hidden, dim, rngs=rngs)

  def __call__(self, x, mask):
    x = x + self.attn(self.norm1(x), mask=mask)
    return x + self.down(nnx.gelu(self.up(self.norm2(x))))


class TinyLM(nnx.Module):

  def __init__(self, vocab: int, dim: int, heads: int, hidden: int, layers: int, *,
               rngs: nnx.Rngs):
    self.embed = nnx.Embed(vocab, dim, rngs=rngs)
    self.blocks = nnx.List([Block(dim, heads, hidden, rngs=rngs) for _ in range(layers)])
    self.norm = nnx.LayerNorm(dim, rngs=rngs)
    self.head = nnx.Linear(dim, vocab, use_bias=False, rngs=rngs)

  def __call__(self, tokens):
    x = self.embed(tokens)
    mask = nnx.make_causal_mask(tokens)
    for block in self.blocks:
      x = block(x, mask)
    return self.head(self.norm(x))


def new_model() -> TinyLM:
  return TinyLM(vocab=256, dim=64, heads=4, hidden=256, layers=2, rngs=nnx.Rngs(0))


def loss_fn(model: TinyLM, batch) -> jax.Array:
  logits = model(batch["inputs"])
  return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()


def text_batches(path: str, batch: int = 16, length: int = 64, seed: int = 0):
  """Random windows of the file's bytes (tokens 0-255) and their next bytes."""
  with open(path, "rb") as file:
    data = np.frombuffer(file.read(), np.uint8).astype(np.int32)
  rng = np.random.default_rng(seed)
  while True:
    starts = rng.integers(0, len(data) - length - 1, batch)
    windows = np.stack([data[s:s + length + 1] for s in starts])
    yield {"inputs": windows[:, :-1], "targets": windows[:, 1:]}


# ---- meshtrain: rules, sharded init, compiled step ---------------------------

def main(text_path: str, steps: int = 20):
  """Trains `steps` steps on the text in `text_path`; returns the losses and the final state."""
  mesh = meshtrain.make_mesh({"fsdp": 4, "tensor": 2})
  trainer = meshtrain.Trainer.for_nnx(new_model, loss_fn, optax.adamw(3e-3), mesh,
                                      patterns=meshtrain.FLAX_TRANSFORMER)
  print(trainer.placement_table())
  state = trainer.init()
  losses = []
  for step, batch in zip(range(1, steps + 1), text_batches(text_path)):
    state, metrics = trainer.step(state, trainer.place(batch))
    losses.append(float(metrics["loss"]))
    print(f"step {step}: loss {losses[-1]:.4f}")
  return losses, state


if __name__ == "__main__":
  if len(sys.argv) != 2:
    sys.exit("usage: python examples/flax_model.py TEXT_FILE  (any UTF-8 text file)")
  main(sys.argv[1])
