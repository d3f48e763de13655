"""The decoder's building blocks: annotated weights, RMSNorm, the weight matmul
that recomputes its cast, and the SwiGLU MLP (dense here; routed in `moe.py`).

Every weight carries logical axis names (`meshtrain.rules`) and is created
in float32; matmuls cast it to the activations' dtype. The names of the
weight matmuls' outputs are what `remat="selective"` keeps.
"""

import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from meshtrain import rules as r
from meshtrain.parallel import float8 as float8_lib

QKV, ATTN_OUT, MLP_IN, MLP_OUT = "qkv", "attn_out", "mlp_in", "mlp_out"


def param(rngs: nnx.Rngs, shape: tuple[int, ...], names: tuple[str | None, ...],
          fan_in: float) -> nnx.Param:
  """A normal(0, 1/sqrt(fan_in)) weight annotated with logical names; it is
  sharded by whoever creates it (`meshtrain.train.state`), not eagerly."""
  value = jax.random.normal(rngs.params(), shape, jnp.float32) * fan_in**-0.5
  return nnx.Param(value, sharding_names=names, eager_sharding=False)


def zeros(shape: tuple[int, ...], names: tuple[str | None, ...]) -> nnx.Param:
  """A zero-initialised weight (a bias) annotated with logical names."""
  return nnx.Param(jnp.zeros(shape, jnp.float32), sharding_names=names, eager_sharding=False)


class RMSNorm(nnx.Module):

  def __init__(self, dim: int, eps: float):
    self.scale = nnx.Param(jnp.ones((dim,), jnp.float32), sharding_names=(r.NORM,),
                           eager_sharding=False)
    self.eps = eps

  def __call__(self, x_BxLxD: jax.Array) -> jax.Array:
    return rms_norm(x_BxLxD, self.scale[...], self.eps)


@functools.partial(jax.checkpoint, static_argnums=(2,))
def rms_norm(x_BxLxD: jax.Array, scale_D: jax.Array, eps: float) -> jax.Array:
  """Normalised in float32, recomputed in the backward from the input: saved,
  its float32 copy and normalised value would be 4x a 16-bit input."""
  x32 = x_BxLxD.astype(jnp.float32)
  y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  return (y * scale_D.astype(jnp.float32)).astype(x_BxLxD.dtype)


def weight_matmul(equation: str, x: jax.Array, *weights: jax.Array,
                  fuse=lambda w: w, float8: str = "none") -> jax.Array:
  """`einsum(equation, x, fuse(*weights))` with the weights cast to x's dtype
  (its GEMMs in float8 by the `float8` recipe: `meshtrain.parallel.float8`),
  the cast and fused weight built again in the backward instead of saved:
  saved, it is a weight-sized residual in every layer (the q/k/v and gate/up
  concatenations: 285 MB per llama_8b layer). Only the cheap cast and
  concatenation run twice; the matmul's output is not needed to differentiate
  it, so its recomputation is dead code. Made for the layers' loop, where the
  forward and the backward are separate loops and nothing can merge the two
  casts: the recomputation takes no optimisation barrier (`prevent_cse=False`),
  which would keep each layer's weight all-gather in its own iteration of the
  backward instead of prefetched under the previous one (docs/gpu_program.md).
  Outside a loop (the multi-token prediction modules under `remat="none"`)
  XLA may merge the two and keep the module's cast weights to its backward."""
  @functools.partial(jax.checkpoint, prevent_cse=False)
  def matmul(x, *weights):
    w = fuse(*(w.astype(x.dtype) for w in weights))
    return (jnp.einsum(equation, x, w) if float8 == "none"
            else float8_lib.einsum(equation, x, w, float8))
  return matmul(x, *weights)


class MLP(nnx.Module):
  """SwiGLU: down(silu(gate(x)) * up(x)), its hidden width `hidden_dim`."""

  def __init__(self, embed_dim: int, hidden_dim: int, rngs: nnx.Rngs, float8: str = "none"):
    d, f = embed_dim, hidden_dim
    self.float8 = float8  # the recipe of its matmuls (`weight_matmul`)
    self.w_gate_DxF = param(rngs, (d, f), (r.EMBED, r.MLP), d)
    self.w_up_DxF = param(rngs, (d, f), (r.EMBED, r.MLP), d)
    self.w_down_FxD = param(rngs, (f, d), (r.MLP, r.EMBED), f)

  def __call__(self, x_BxLxD: jax.Array) -> jax.Array:
    # Gate and up in one matmul: one all-reduce of the input gradient under
    # tensor parallelism, not two.
    gate_up_2xBxLxF = r.constrain(
        weight_matmul("bld,cdf->cblf", x_BxLxD, self.w_gate_DxF[...], self.w_up_DxF[...],
                      fuse=lambda *w: jnp.stack(w), float8=self.float8),
        (None, r.BATCH, r.LENGTH, r.ACT_MLP))
    gate_BxLxF, up_BxLxF = checkpoint_name(gate_up_2xBxLxF, MLP_IN)
    h_BxLxF = r.constrain(swiglu(gate_BxLxF, up_BxLxF), (r.BATCH, r.LENGTH, r.ACT_MLP))
    return checkpoint_name(weight_matmul("blf,fd->bld", h_BxLxF, self.w_down_FxD[...],
                                         float8=self.float8), MLP_OUT)


@jax.checkpoint
def swiglu(gate_BxLxF: jax.Array, up_BxLxF: jax.Array) -> jax.Array:
  """silu(gate) * up, recomputed in the backward from gate and up: saved, its
  sigmoid and products would double the MLP's residuals."""
  return jax.nn.silu(gate_BxLxF) * up_BxLxF
