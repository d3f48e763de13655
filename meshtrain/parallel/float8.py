"""Float8 matmuls with current scaling (`config.float8`), forward and backward.

Each operand of each of a matmul's three GEMMs (the forward, the input
gradient, the weight gradient) is quantized just in time: divided by a float32
scale, its absolute maximum over the scaling group divided by the float8
format's largest value, clipped to it and rounded to the format; the GEMM
multiplies the float8 operands with float32 accumulation and multiplies its
output by the two scales. An all-zero group has scale 1.

Recipes:
  - `tensorwise`: one scale per operand (torchtitan's and Transformer Engine's
    current scaling). Weights and activations in e4m3; gradients in e5m2,
    whose 5 exponent bits hold the spread of values one scale must cover.
  - `rowwise`: one scale per slice along every dimension the GEMM does not
    contract (per row of the activations, per column of the weights, and per
    row of each backward operand, taken again along that GEMM's own
    contraction); every operand in e4m3, since per-row scales leave each
    group a narrow range and e4m3's extra mantissa bit is the better use.
  - `blockwise`: DeepSeek-V3's groups, e4m3 throughout: 1 x BLOCK along the
    last dimension of activations and gradients, BLOCK x BLOCK of weights.
    Their scales change along the contraction, which no GEMM XLA builds
    applies inside, so each operand is rounded by its blocks and the GEMM
    multiplies the dequantized operands in their dtype (`block_einsum`).

What the GEMMs run as is XLA's: in the program its GPU compiler builds for an
H100 (`meshtrain plan --target`) each of them is a Triton GEMM fusion with
float8 operands (docs/float8.md).
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from meshtrain import rules as r

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
# The equations' batch and length letters (the model's shape suffixes), and
# the mesh axes that split them.
TOKEN_DIMS, TOKEN_AXES = frozenset("bl"), ("data", "sequence")


# blockwise: activations and gradients scaled in groups of 1 x BLOCK along
# their last dimension, weights in BLOCK x BLOCK blocks (DeepSeek-V3's).
BLOCK = 128


@dataclasses.dataclass(frozen=True)
class Recipe:
  """How a float8 matmul scales: `per_slice` (rowwise) or one scale per
  operand, or `blocks` (blockwise); and the format of the gradients."""
  per_slice: bool
  gradient: jnp.dtype
  blocks: bool = False


RECIPES = {"tensorwise": Recipe(per_slice=False, gradient=E5M2),
           "rowwise": Recipe(per_slice=True, gradient=E4M3),
           "blockwise": Recipe(per_slice=False, gradient=E4M3, blocks=True)}
CHOICES = ("none", *RECIPES)
# The logical names of the weights whose matmuls `config.float8` runs in
# float8: every block's projections (attention's q, k, v and output, the
# MLP's gate, up and down; the stacked layers' and each multi-token
# prediction module's), each a width of the residual stream (`embed`), or
# Multi-head Latent Attention's latent (its up-projections), by one of these.
# The embedding, the head and a module's input projection (embed by embed)
# stay in the working dtype, and so do MLA's down-projections (embed by
# latent): their narrow outputs (576 and 1,536 wide in DeepSeek-V3) leave
# the GEMMs bound by reading x, which the quantizer would read twice more.
PROJECTION_WIDTHS = frozenset({r.HEADS, r.KV_HEADS, r.MLP})
PROJECTION_INPUTS = frozenset({r.EMBED, r.LATENT})


def float8_gemms(recipe: str) -> bool:
  """Whether `config.float8=recipe` runs the projections' GEMMs, and FSDP's
  gathers of their weights, in float8 (not `none`, nor blockwise's bfloat16
  GEMMs of block-dequantized operands)."""
  return recipe in RECIPES and not RECIPES[recipe].blocks


def runs_in_float8(names: tuple) -> bool:
  """Whether the weight of logical `names` is one of the projections (by
  `PROJECTION_INPUTS` and `PROJECTION_WIDTHS`) whose GEMMs run in float8
  under `config.float8`."""
  return not (PROJECTION_INPUTS.isdisjoint(names) or PROJECTION_WIDTHS.isdisjoint(names))


def quantize(x: jax.Array, dtype, axes: tuple[int, ...] | None,
             over_tokens: bool = False) -> tuple[jax.Array, jax.Array]:
  """`x` in float8 `dtype` and its float32 scale (x ~ q * scale), the absolute
  maximum taken over `axes` (kept as size-1 dimensions; None: all of x);
  `over_tokens`: they include token dimensions, whose share here is this
  device's where a shard_map makes `data` or `sequence` manual (the
  pipeline's stages), so the maximum is taken over those axes too: the
  batch's, as outside one."""
  x32 = x.astype(jnp.float32)
  largest = float(jnp.finfo(dtype).max)
  amax = jnp.max(jnp.abs(x32), axis=axes, keepdims=True)
  mesh = jax.sharding.get_abstract_mesh()
  manual = tuple(a for a in TOKEN_AXES if over_tokens and not mesh.empty
                 and a in mesh.manual_axes and mesh.shape[a] > 1)
  if manual:
    amax = lax.pmax(amax, manual)
  scale = jnp.where(amax > 0, amax / largest, 1.0)
  return jnp.clip(x32 / scale, -largest, largest).astype(dtype), scale


def scaled_einsum(equation: str, a: jax.Array, a_dtype, b: jax.Array, b_dtype, per_slice: bool,
                  out_dtype) -> jax.Array:
  """`einsum(equation, a, b)` as one float8 GEMM: each operand quantized to
  its format, scaled per slice of its dimensions outside the contraction
  (`per_slice`) or as a whole."""
  inputs, out = equation.split("->")
  a_dims, b_dims = inputs.split(",")
  contracted = (set(a_dims) & set(b_dims)) - set(out)

  def axes(dims: str) -> tuple[int, ...] | None:
    return tuple(i for i, d in enumerate(dims) if d in contracted) if per_slice else None

  def over_tokens(dims: str) -> bool:
    return bool(TOKEN_DIMS & (contracted if per_slice else set(dims)))
  qa, a_scale = quantize(a, a_dtype, axes(a_dims), over_tokens(a_dims))
  qb, b_scale = quantize(b, b_dtype, axes(b_dims), over_tokens(b_dims))
  product = jnp.einsum(equation, qa, qb, preferred_element_type=jnp.float32)
  # The scales as the output's broadcast: outer products of the slices' scales
  # (their contracted dimensions have size 1), or one number.
  scale = (jnp.einsum(equation, a_scale, b_scale) if per_slice
           else a_scale.reshape(()) * b_scale.reshape(()))
  return (product * scale).astype(out_dtype)


def block_dequantized(x: jax.Array, dtype, axes: tuple[int, ...]) -> jax.Array:
  """`x` quantized to float8 `dtype` with a float32 scale per block of up to
  BLOCK along each of `axes` and 1 along the others (a dimension that BLOCK
  does not divide ends in a shorter block), and dequantized back to x's
  dtype. Token dimensions are never among `axes`, so that a device's blocks
  are its own wherever a shard_map splits the tokens."""
  shape, x32 = x.shape, x.astype(jnp.float32)
  pads = [(0, -n % BLOCK if i in axes and n > BLOCK else 0) for i, n in enumerate(shape)]
  padded = jnp.pad(x32, pads) if any(pad for _, pad in pads) else x32
  blocked, within = [], []
  for i, n in enumerate(padded.shape):
    if i in axes:
      length = min(BLOCK, n)
      blocked += [n // length, length]
      within.append(len(blocked) - 1)
    else:
      blocked.append(n)
  # The barrier keeps the rounding: XLA's GPU compiler drops a conversion to
  # a narrower float and straight back (`xla_allow_excess_precision`).
  q, scale = lax.optimization_barrier(quantize(padded.reshape(blocked), dtype, tuple(within)))
  restored = (q.astype(jnp.float32) * scale).reshape(padded.shape)
  return restored[tuple(slice(0, n) for n in shape)].astype(x.dtype)


def _block_axes(equation: str) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
  """The blocked axes of an activation x, a weight w and the output's
  gradient g of `einsum(equation, x, w)`: x's and g's last (their channels:
  1 x BLOCK groups), w's last contracted and last kept (BLOCK x BLOCK)."""
  inputs, out = equation.split("->")
  x_dims, w_dims = inputs.split(",")
  contracted = [i for i, d in enumerate(w_dims) if d in x_dims and d not in out]
  kept = [i for i, d in enumerate(w_dims) if d in out]
  return (len(x_dims) - 1,), (contracted[-1], kept[-1]), (len(out) - 1,)


def block_einsum(equation: str, a: jax.Array, a_axes: tuple[int, ...], b: jax.Array,
                 b_axes: tuple[int, ...], out_dtype) -> jax.Array:
  """`einsum(equation, a, b)` of the operands quantized to e4m3 by blocks
  (`block_dequantized`), on the dequantized operands in their dtype with
  float32 accumulation: XLA has no GEMM whose operands' scales change along
  the contraction, so the blocks' numerics are DeepSeek-V3's and the GEMM a
  bfloat16 one (docs/float8.md)."""
  return jnp.einsum(equation, block_dequantized(a, E4M3, a_axes),
                    block_dequantized(b, E4M3, b_axes),
                    preferred_element_type=jnp.float32).astype(out_dtype)


def einsum(equation: str, x: jax.Array, w: jax.Array, recipe: str) -> jax.Array:
  """`einsum(equation, x, w)` (an activation and a weight, in x's dtype) with
  its three GEMMs in float8 by `recipe` (`RECIPES`)."""
  return _float8_einsum(equation, RECIPES[recipe], x, w)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _float8_einsum(equation: str, recipe: Recipe, x: jax.Array, w: jax.Array) -> jax.Array:
  if recipe.blocks:
    x_axes, w_axes, _ = _block_axes(equation)
    return block_einsum(equation, x, x_axes, w, w_axes, x.dtype)
  return scaled_einsum(equation, x, E4M3, w, E4M3, recipe.per_slice, x.dtype)


def _forward(equation: str, recipe: Recipe, x: jax.Array, w: jax.Array):
  return _float8_einsum(equation, recipe, x, w), (x, w)


def _backward(equation: str, recipe: Recipe, residuals, g: jax.Array):
  x, w = residuals
  inputs, out = equation.split("->")
  x_dims, w_dims = inputs.split(",")
  if recipe.blocks:
    x_axes, w_axes, g_axes = _block_axes(equation)
    return (block_einsum(f"{out},{w_dims}->{x_dims}", g, g_axes, w, w_axes, x.dtype),
            block_einsum(f"{x_dims},{out}->{w_dims}", x, x_axes, g, g_axes, w.dtype))
  g_x = scaled_einsum(f"{out},{w_dims}->{x_dims}", g, recipe.gradient, w, E4M3, recipe.per_slice,
                      x.dtype)
  g_w = scaled_einsum(f"{x_dims},{out}->{w_dims}", x, E4M3, g, recipe.gradient, recipe.per_slice,
                      w.dtype)
  return g_x, g_w


_float8_einsum.defvjp(_forward, _backward)
