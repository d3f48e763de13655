"""The ReLU case of issue 20: a sharded gradient that differs from one device's
by 1e-4 to 1e-2 with ReLU, while GELU agrees to 1e-6. jax 0.10.2 on CPU,
8 simulated devices, a one-block Linen transformer as flax's examples write it.

  python docs/repro/relu_kink.py

Not a miscompile: one MLP pre-activation of the batch lies within an ulp of
zero, and the fsdp program, whose sums run in another order, puts it on the
other side. ReLU's derivative jumps there (0 or 1), so that unit's whole
contribution to the gradient appears in one program and not in the other.
GELU is smooth there. With float64 weights both programs agree to 1e-15;
`jax_enable_x64` alone changes nothing, since Linen keeps float32 weights.
"""
import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P  # noqa: E402

VOCAB, WIDTH, HEADS, MLP = 64, 32, 4, 64
SEED = 729  # a batch with a pre-activation on the kink (found by --search)


class Block(nn.Module):
  activation: str

  @nn.compact
  def __call__(self, x):
    h = nn.LayerNorm()(x)
    x = x + nn.MultiHeadDotProductAttention(num_heads=HEADS)(
        h, h, mask=nn.make_causal_mask(jnp.ones(x.shape[:2])))
    up = nn.Dense(MLP, name="up")(nn.LayerNorm()(x))
    self.sow("intermediates", "pre_activation", up)
    return x + nn.Dense(WIDTH, name="down")(getattr(nn, self.activation)(up))


class LM(nn.Module):
  activation: str

  @nn.compact
  def __call__(self, tokens):
    x = Block(self.activation)(nn.Embed(VOCAB, WIDTH)(tokens))
    return nn.Dense(VOCAB)(nn.LayerNorm()(x))


def layout(path: str, ndim: int) -> P:
  """fsdp over 8 devices, as meshtrain's FLAX_TRANSFORMER patterns place this
  model: each kernel's first dimension split (the embedding's and the
  attention output's last), vectors whole."""
  if path.endswith("embedding"):
    return P(None, "fsdp")
  if "out/kernel" in path:
    return P(None, None, "fsdp")
  if path.endswith("kernel"):
    return P("fsdp", *(None,) * (ndim - 1))
  return P()


def batch(seed: int):
  tokens = np.random.default_rng(seed).integers(0, VOCAB, (16, 33), dtype=np.int32)
  return tokens[:, :-1], tokens[:, 1:]


def programs(activation: str, dtype=jnp.float32):
  """compare(seed) -> (largest relative gradient difference, pre-activations
  whose sign differs) between fsdp=8 and one device, both under plain jax.jit."""
  model = LM(activation)
  params = model.init(jax.random.key(0), batch(0)[0])["params"]
  params = jax.tree.map(lambda w: w.astype(dtype), params)

  def loss(params, inputs, targets):
    logits = model.apply({"params": params}, inputs)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

  def gradient_and_pre_activation(params, inputs, targets):
    _, state = model.apply({"params": params}, inputs, mutable="intermediates")
    pre_activation = state["intermediates"]["Block_0"]["pre_activation"][0]
    return jax.grad(loss)(params, inputs, targets), pre_activation

  mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(AxisType.Auto,))
  shardings = jax.tree_util.tree_map_with_path(
      lambda path, w: NamedSharding(mesh, layout(jax.tree_util.keystr(path), w.ndim)), params)
  rows = NamedSharding(mesh, P("fsdp"))
  one_device = jax.jit(gradient_and_pre_activation)
  fsdp = jax.jit(gradient_and_pre_activation, in_shardings=(shardings, rows, rows),
                 out_shardings=(shardings, rows))

  def compare(seed: int) -> tuple[float, int]:
    (ref, ref_h), (got, got_h) = (run(params, *batch(seed)) for run in (one_device, fsdp))
    # against 1% of the largest gradient: the key bias's is zero but for rounding
    floor = 1e-2 * max(float(jnp.linalg.norm(r)) for r in jax.tree.leaves(ref))
    worst = max(float(jnp.linalg.norm(g - r)) / max(float(jnp.linalg.norm(r)), floor)
                for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(ref)))
    return worst, int((jnp.sign(got_h) != jnp.sign(ref_h)).sum())
  return compare


if __name__ == "__main__":
  print(f"jax {jax.__version__}, {jax.devices()[0].platform} x{jax.device_count()}")
  if "--search" in sys.argv:
    compare = programs("relu")
    print("batches with a sign flip:", [seed for seed in range(2000) if compare(seed)[1]])
  else:
    for activation in ("relu", "gelu"):
      worst, flips = programs(activation)(SEED)
      print(f"{activation}: worst gradient difference {worst:.1e}, pre-activations on the "
            f"other side of zero: {flips}")
    with jax.enable_x64(True):
      for dtype in (jnp.float32, jnp.float64):
        worst, flips = programs("relu", dtype)(SEED)
        print(f"relu, jax_enable_x64, {jnp.dtype(dtype).name} weights: worst {worst:.1e}, "
              f"other side: {flips}")
