"""A Llama-style decoder in flax NNX: RMSNorm, rotary positions, SwiGLU MLP and
grouped-query attention, with the layers stacked on a leading `layers` axis and
run by `lax.scan` (one compiled layer, whatever the depth).

Every weight carries logical axis names (`meshtrain.rules`); the main
activations are pinned with `rules.constrain`. Weights are stored in whatever
dtype the caller hands in and cast to `compute_dtype` at each matmul.

The model knows no strategy. A strategy that rewrites the program fills one
of its `Slots` (`meshtrain.train.parallelize` does, as torchtitan's
`parallelize` does): the attention kernel, and where each layer's weights
come from. The defaults run it as written on whatever layout the rules give.
"""

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, Literal

import flax.core.spmd
import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from meshtrain import rules as r
from meshtrain.models import rope
from meshtrain.models.rope import rotary
from meshtrain.parallel import attention

Remat = Literal["none", "full", "selective"]
# Names of the weight matmuls' outputs, which `remat="selective"` keeps.
QKV, ATTN_OUT, MLP_IN, MLP_OUT = "qkv", "attn_out", "mlp_in", "mlp_out"


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
  vocab_size: int
  embed_dim: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  mlp_dim: int
  rope_theta: float = 10_000.0
  norm_eps: float = 1e-5
  tie_embeddings: bool = False
  compute_dtype: str = "float32"
  remat: Remat = "none"
  rope_scaling_factor: float = 1.0  # Llama 3's RoPE scaling (models/rope.py); 1: none
  rope_low_freq_factor: float = 1.0
  rope_high_freq_factor: float = 4.0
  rope_original_max_positions: int = 8192

  @property
  def rope_scaling(self) -> rope.Llama3Scaling | None:
    if self.rope_scaling_factor == 1:
      return None
    return rope.Llama3Scaling(self.rope_scaling_factor, self.rope_low_freq_factor,
                              self.rope_high_freq_factor, self.rope_original_max_positions)


def _param(rngs: nnx.Rngs, shape: tuple[int, ...], names: tuple[str, ...],
           fan_in: int) -> nnx.Param:
  """A normal(0, 1/sqrt(fan_in)) weight annotated with logical names; it is
  sharded by whoever creates it (`meshtrain.train.state`), not eagerly."""
  value = jax.random.normal(rngs.params(), shape, jnp.float32) * fan_in**-0.5
  return nnx.Param(value, sharding_names=names, eager_sharding=False)


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
                  fuse=lambda w: w) -> jax.Array:
  """`einsum(equation, x, fuse(*weights))` with the weights cast to x's dtype,
  the cast and fused weight built again in the backward instead of saved:
  saved, it is a weight-sized residual in every layer (the q/k/v and gate/up
  concatenations: 285 MB per llama_8b layer). Only the cheap cast and
  concatenation run twice; the matmul's output is not needed to differentiate
  it, so its recomputation is dead code."""
  @jax.checkpoint
  def matmul(x, *weights):
    return jnp.einsum(equation, x, fuse(*(w.astype(x.dtype) for w in weights)))
  return matmul(x, *weights)


def _as_they_are(weights: Any) -> Any:
  return weights


@dataclasses.dataclass(frozen=True)
class Slots:
  """What a strategy may plug into the model.

  attention(q_BxLxNxH, k_BxLxKxH, v_BxLxKxH, segment_ids_BxL=None) -> out_BxLxNxH:
    causal grouped-query attention over the sequence (inside each packed
    document), whatever splits its length; the default sees it whole.
  layer_weights(weights) -> weights: one layer's weights, as its layer runs
    (offload brings them from the host here); the default returns them.
  """
  attention: Callable[..., jax.Array] = attention.causal_attention
  layer_weights: Callable[[Any], Any] = _as_they_are


class Attention(nnx.Module):

  def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs,
               attend: Callable[..., jax.Array] = attention.causal_attention):
    d, n, k, h = cfg.embed_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    self.cfg, self.attend = cfg, attend
    self.wq_DxNxH = _param(rngs, (d, n, h), (r.EMBED, r.HEADS, r.HEAD_DIM), d)
    self.wk_DxKxH = _param(rngs, (d, k, h), (r.EMBED, r.KV_HEADS, r.HEAD_DIM), d)
    self.wv_DxKxH = _param(rngs, (d, k, h), (r.EMBED, r.KV_HEADS, r.HEAD_DIM), d)
    self.wo_NxHxD = _param(rngs, (n, h, d), (r.HEADS, r.HEAD_DIM, r.EMBED), n * h)

  def project_qkv(self, x_BxLxD: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """q, k, v in one matmul when the kv heads are split like the query heads:
    under tensor parallelism the backward then all-reduces one input gradient,
    not three (Megatron's fused QKV; XLA's CPU compile does not merge the three).
    The query heads of a kv group sit next to each other, so [D, N, H] ->
    [D, K, N/K, H] keeps the head split local."""
    wq, wk, wv = (w[...] for w in (self.wq_DxNxH, self.wk_DxKxH, self.wv_DxKxH))
    rules = dict(flax.core.spmd.get_logical_axis_rules() or ())
    if rules.get(r.KV_HEADS) != rules.get(r.HEADS):  # kv heads whole, query heads split
      return tuple(checkpoint_name(weight_matmul(equation, x_BxLxD, w), QKV)
                   for equation, w in (("bld,dnh->blnh", wq), ("bld,dkh->blkh", wk),
                                       ("bld,dkh->blkh", wv)))
    (d, n, h), k = wq.shape, wk.shape[1]

    def fuse(wq, wk, wv):
      return jnp.concatenate([wq.reshape(d, k, n // k, h), wk[:, :, None], wv[:, :, None]], 2)

    qkv_BxLxKxGxH = r.constrain(weight_matmul("bld,dkgh->blkgh", x_BxLxD, wq, wk, wv, fuse=fuse),
                                (r.BATCH, r.LENGTH, r.ACT_KV_HEADS, None, r.HEAD_DIM))
    qkv_BxLxKxGxH = checkpoint_name(qkv_BxLxKxGxH, QKV)
    batch, length = x_BxLxD.shape[:2]
    return (qkv_BxLxKxGxH[:, :, :, :-2].reshape(batch, length, n, h),
            qkv_BxLxKxGxH[:, :, :, -2], qkv_BxLxKxGxH[:, :, :, -1])

  def __call__(self, x_BxLxD: jax.Array, positions_BxL: jax.Array,
               segment_ids_BxL: jax.Array | None = None) -> jax.Array:
    cfg, dtype = self.cfg, x_BxLxD.dtype
    q_BxLxNxH, k_BxLxKxH, v_BxLxKxH = self.project_qkv(x_BxLxD)
    q_BxLxNxH = r.constrain(rotary(q_BxLxNxH, positions_BxL, cfg.rope_theta, cfg.rope_scaling),
                            (r.BATCH, r.LENGTH, r.ACT_HEADS, r.HEAD_DIM))
    k_BxLxKxH = r.constrain(rotary(k_BxLxKxH, positions_BxL, cfg.rope_theta, cfg.rope_scaling),
                            (r.BATCH, r.LENGTH, r.ACT_KV_HEADS, r.HEAD_DIM))
    v_BxLxKxH = r.constrain(v_BxLxKxH, (r.BATCH, r.LENGTH, r.ACT_KV_HEADS, r.HEAD_DIM))
    if dtype == jnp.float16 and jax.default_backend() == "cpu":
      # jax's float16 attention asks for an F16_F16_F32 dot, which CPU does not lower.
      q_BxLxNxH, k_BxLxKxH, v_BxLxKxH = (x.astype(jnp.float32) for x in
                                          (q_BxLxNxH, k_BxLxKxH, v_BxLxKxH))
    out_BxLxNxH = self.attend(q_BxLxNxH, k_BxLxKxH, v_BxLxKxH, segment_ids_BxL=segment_ids_BxL)
    out_BxLxNxH = r.constrain(out_BxLxNxH.astype(dtype),
                              (r.BATCH, r.LENGTH, r.ACT_HEADS, r.HEAD_DIM))
    return checkpoint_name(weight_matmul("blnh,nhd->bld", out_BxLxNxH, self.wo_NxHxD[...]),
                           ATTN_OUT)


class MLP(nnx.Module):
  """SwiGLU: down(silu(gate(x)) * up(x))."""

  def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
    d, f = cfg.embed_dim, cfg.mlp_dim
    self.w_gate_DxF = _param(rngs, (d, f), (r.EMBED, r.MLP), d)
    self.w_up_DxF = _param(rngs, (d, f), (r.EMBED, r.MLP), d)
    self.w_down_FxD = _param(rngs, (f, d), (r.MLP, r.EMBED), f)

  def __call__(self, x_BxLxD: jax.Array) -> jax.Array:
    # Gate and up in one matmul: one all-reduce of the input gradient under
    # tensor parallelism, not two.
    gate_up_2xBxLxF = r.constrain(
        weight_matmul("bld,cdf->cblf", x_BxLxD, self.w_gate_DxF[...], self.w_up_DxF[...],
                      fuse=lambda *w: jnp.stack(w)), (None, r.BATCH, r.LENGTH, r.ACT_MLP))
    gate_BxLxF, up_BxLxF = checkpoint_name(gate_up_2xBxLxF, MLP_IN)
    h_BxLxF = r.constrain(swiglu(gate_BxLxF, up_BxLxF), (r.BATCH, r.LENGTH, r.ACT_MLP))
    return checkpoint_name(weight_matmul("blf,fd->bld", h_BxLxF, self.w_down_FxD[...]), MLP_OUT)


@jax.checkpoint
def swiglu(gate_BxLxF: jax.Array, up_BxLxF: jax.Array) -> jax.Array:
  """silu(gate) * up, recomputed in the backward from gate and up: saved, its
  sigmoid and products would double the MLP's residuals."""
  return jax.nn.silu(gate_BxLxF) * up_BxLxF


class Block(nnx.Module):
  """Pre-norm residual block: x + attn(norm(x)), then + mlp(norm(x))."""

  def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs, slots: Slots = Slots()):
    self.attn_norm = RMSNorm(cfg.embed_dim, cfg.norm_eps)
    self.attn = Attention(cfg, rngs, slots.attention)
    self.mlp_norm = RMSNorm(cfg.embed_dim, cfg.norm_eps)
    self.mlp = MLP(cfg, rngs)

  def __call__(self, x_BxLxD: jax.Array, positions_BxL: jax.Array,
               segment_ids_BxL: jax.Array | None = None) -> jax.Array:
    residual = (r.BATCH, r.RES_LENGTH, r.ACT_EMBED)
    x_BxLxD = r.constrain(
        x_BxLxD + self.attn(self.attn_norm(x_BxLxD), positions_BxL, segment_ids_BxL), residual)
    return r.constrain(x_BxLxD + self.mlp(self.mlp_norm(x_BxLxD)), residual)


REMAT_POLICIES = {
    "full": jax.checkpoint_policies.nothing_saveable,
    # Keep the outputs of the weight matmuls (named above); recompute norms,
    # rotary, attention and SwiGLU's product. Korthikanti et al.'s selective
    # recomputation recomputes only attention.
    "selective": jax.checkpoint_policies.save_only_these_names(QKV, ATTN_OUT, MLP_IN, MLP_OUT),
}


class Embed(nnx.Module):

  def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
    self.dtype = jnp.dtype(cfg.compute_dtype)
    self.embedding_VxD = _param(rngs, (cfg.vocab_size, cfg.embed_dim), (r.VOCAB, r.EMBED),
                                cfg.embed_dim)

  def table(self) -> jax.Array:
    """The table in its compute layout (`embed` whole, like every weight in a
    matmul): a lookup in a table split along `embed` makes GSPMD reshuffle the
    looked-up rows through a full replication instead."""
    return r.constrain(self.embedding_VxD[...], (r.VOCAB, r.ACT_EMBED))

  def __call__(self, tokens_BxL: jax.Array) -> jax.Array:
    return r.constrain(self.table()[tokens_BxL].astype(self.dtype),
                       (r.BATCH, r.RES_LENGTH, r.ACT_EMBED))


@jax.custom_vjp
def vocab_logits(x_BxLxD: jax.Array, w_DxV: jax.Array) -> jax.Array:
  """`x @ w` to float32 logits, whose backward multiplies in the inputs' dtype.

  jax's own transpose of a bfloat16 x bfloat16 -> float32 matmul multiplies the
  float32 logit gradient with the bfloat16 operands: two float32 (at best TF32)
  GEMMs on the largest matmuls of a small model, reading a [batch, length,
  vocab] gradient twice the size. Here that gradient is cast to the inputs'
  dtype first, as every other activation gradient already is; in float32 the
  two are the same.
  """
  return jnp.einsum("bld,dv->blv", x_BxLxD, w_DxV, preferred_element_type=jnp.float32)


def _vocab_logits_fwd(x_BxLxD, w_DxV):
  return vocab_logits(x_BxLxD, w_DxV), (x_BxLxD, w_DxV)


def _vocab_logits_bwd(residuals, g_BxLxV):
  x_BxLxD, w_DxV = residuals
  g_BxLxV = g_BxLxV.astype(x_BxLxD.dtype)
  g_x = jnp.einsum("blv,dv->bld", g_BxLxV, w_DxV, preferred_element_type=jnp.float32)
  g_w = jnp.einsum("bld,blv->dv", x_BxLxD, g_BxLxV, preferred_element_type=jnp.float32)
  return g_x.astype(x_BxLxD.dtype), g_w.astype(w_DxV.dtype)


vocab_logits.defvjp(_vocab_logits_fwd, _vocab_logits_bwd)


class Head(nnx.Module):
  """Final norm and output projection to float32 logits (vocabulary-parallel
  under `tensor`); with tied embeddings the projection is the embedding table."""

  def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
    self.final_norm = RMSNorm(cfg.embed_dim, cfg.norm_eps)
    if not cfg.tie_embeddings:
      self.head_DxV = _param(rngs, (cfg.embed_dim, cfg.vocab_size), (r.EMBED, r.VOCAB),
                             cfg.embed_dim)

  def __call__(self, x_BxLxD: jax.Array, tied_VxD: jax.Array | None = None) -> jax.Array:
    x_BxLxD = self.final_norm(x_BxLxD)
    head_DxV = tied_VxD.T if tied_VxD is not None else self.head_DxV[...]
    logits_BxLxV = vocab_logits(x_BxLxD, head_DxV.astype(x_BxLxD.dtype))
    return r.constrain(logits_BxLxV, (r.BATCH, r.LENGTH, r.ACT_VOCAB))


def stacked_blocks(cfg: LlamaConfig, rngs: nnx.Rngs, slots: Slots = Slots()) -> Block:
  """num_layers blocks whose weights carry a leading `layers` axis."""
  @nnx.split_rngs(splits=cfg.num_layers)
  @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: r.LAYERS})
  def create(rngs: nnx.Rngs) -> Block:
    return Block(cfg, rngs, slots)
  return create(rngs)


def run_layers(layers: Block, x_BxLxD: jax.Array, positions_BxL: jax.Array | None = None,
               remat: Remat = "none", segment_ids_BxL: jax.Array | None = None,
               layer_weights: Callable[[Any], Any] = _as_they_are) -> jax.Array:
  """Runs stacked blocks (any number: the whole model or a pipeline chunk) with
  one `lax.scan`, recomputing activations by the `remat` policy; with
  `segment_ids_BxL`, attention stays inside each packed document. Positions
  default to `default_positions`; each layer's weights pass through
  `layer_weights` (`Slots.layer_weights`) as it runs."""
  if positions_BxL is None:
    positions_BxL = default_positions(x_BxLxD, segment_ids_BxL)
  graphdef, layer_state = nnx.split(layers)

  def layer(x_BxLxD, state):
    block = nnx.merge(graphdef, layer_weights(state))
    return block(x_BxLxD, positions_BxL, segment_ids_BxL), None

  if remat != "none":
    layer = jax.checkpoint(layer, policy=REMAT_POLICIES[remat])
  return jax.lax.scan(layer, x_BxLxD, layer_state)[0]


def positions(tokens_BxL: jax.Array) -> jax.Array:
  return jnp.broadcast_to(jnp.arange(tokens_BxL.shape[1]), tokens_BxL.shape[:2])


def document_positions(segment_ids_BxL: jax.Array) -> jax.Array:
  """Each token's index inside its packed document: 0 where the segment id
  changes, counting up until the next change."""
  index_BxL = positions(segment_ids_BxL)
  starts_BxL = jnp.where(
      jnp.diff(segment_ids_BxL, axis=1, prepend=segment_ids_BxL[:, :1] - 1) != 0, index_BxL, 0)
  return index_BxL - jax.lax.cummax(starts_BxL, axis=1)


def default_positions(tokens_BxL: jax.Array, segment_ids_BxL: jax.Array | None) -> jax.Array:
  """Rotary positions when none are given: each token's index, inside its
  document when packed. Only the shape of `tokens_BxL` ([B, L, ...]) counts."""
  return positions(tokens_BxL) if segment_ids_BxL is None else document_positions(segment_ids_BxL)


class Llama(nnx.Module):

  def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs, slots: Slots = Slots()):
    self.cfg, self.slots = cfg, slots
    self.embed = Embed(cfg, rngs)
    self.layers = stacked_blocks(cfg, rngs, slots)
    self.head = Head(cfg, rngs)

  def __call__(self, tokens_BxL: jax.Array, segment_ids: jax.Array | None = None,
               positions: jax.Array | None = None) -> jax.Array:
    """Returns float32 logits [batch, length, vocab], one per token in the
    order given. Packed documents: `segment_ids` [batch, length] (0 =
    padding) keep attention inside each document; `positions` (rotary; by
    default each token's index inside its document) restart there."""
    x_BxLxD = run_layers(self.layers, self.embed(tokens_BxL), positions, self.cfg.remat,
                         segment_ids, self.slots.layer_weights)
    return self.head(x_BxLxD, self.embed.table() if self.cfg.tie_embeddings else None)
