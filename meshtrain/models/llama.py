"""A Llama-style decoder in flax NNX: RMSNorm, rotary positions, grouped-query
or latent attention (`mla.py`: DeepSeek-V2/V3) and a SwiGLU MLP, dense or
Mixture-of-Experts (`moe.py`: Mixtral, Qwen-MoE, DeepSeek-V3). The families'
variations are options of the one model: q/k/v biases (Qwen2), per-head q/k
RMSNorm (Qwen3), a sliding attention window (Mistral), tied embeddings. The
layers are stacked on a leading `layers` axis and run by `lax.scan` (one
compiled layer, whatever the depth). With `moe.first_dense_layers` the first
layers keep the dense MLP and form a stack of their own (`dense_layers`), run
before the others.

Every weight carries logical axis names (`meshtrain.rules`); the main
activations are pinned with `rules.constrain`. Weights are stored in whatever
dtype the caller hands in and cast to `compute_dtype` at each matmul. The MoE
router's selection bias is model state (`nnx.BatchStat`), not a weight.

The model knows no strategy. A strategy that rewrites the program fills one
of its `Slots` (`meshtrain.train.parallelize` does, as torchtitan's
`parallelize` does): the attention kernel, how routed tokens reach their
experts, where each layer's weights come from. The defaults run it as written
on whatever layout the rules give.
"""

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any, Literal

import flax.core.spmd
import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from meshtrain import rules as r
from meshtrain.models import mla, rope
from meshtrain.models.mla import MLAConfig
from meshtrain.models.layers import (ATTN_OUT, MLP, MLP_IN, MLP_OUT, QKV, RMSNorm, param,
                                     weight_matmul, zeros)
from meshtrain.models.moe import MoE, MoEConfig
from meshtrain.models.rope import rotary
from meshtrain.parallel import attention, experts, sequence

Remat = Literal["none", "full", "selective", "offload"]


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
  qkv_bias: bool = False     # biases on the q, k, v projections (Qwen2)
  qk_norm: bool = False      # RMSNorm of each q and k head before RoPE (Qwen3)
  sliding_window: int = 0    # attend to the last N tokens (Mistral); 0: the whole prefix
  compute_dtype: str = "float32"
  float8: str = "none"       # the projections' GEMMs in float8 (`meshtrain.parallel.float8`)
  remat: Remat = "none"
  rope_scaling_factor: float = 1.0  # RoPE's context scaling (models/rope.py); 1: none
  rope_low_freq_factor: float = 1.0
  rope_high_freq_factor: float = 4.0
  rope_original_max_positions: int = 8192
  rope_scaling_type: str = "llama3"  # llama3 | yarn
  rope_beta_fast: float = 32.0
  rope_beta_slow: float = 1.0
  rope_attention_factor: float = 0.0
  rope_mscale: float = 0.0
  rope_mscale_all_dim: float = 0.0
  rope_truncate: bool = True
  moe: MoEConfig = MoEConfig()
  mla: MLAConfig = MLAConfig()
  mtp_layers: int = 0        # multi-token prediction modules (`MultiTokenPrediction`)
  mtp_loss_coef: float = 0.1  # the weight of their mean loss in the training loss

  @property
  def rope_scaling(self) -> rope.Llama3Scaling | rope.YarnScaling | None:
    if self.rope_scaling_factor == 1:
      return None
    if self.rope_scaling_type == "yarn":
      return rope.YarnScaling(self.rope_scaling_factor, self.rope_original_max_positions,
                              self.rope_beta_fast, self.rope_beta_slow, self.rope_attention_factor,
                              self.rope_mscale, self.rope_mscale_all_dim, self.rope_truncate)
    return rope.Llama3Scaling(self.rope_scaling_factor, self.rope_low_freq_factor,
                              self.rope_high_freq_factor, self.rope_original_max_positions)


def _batch_sum(x_BxLx: jax.Array) -> jax.Array:
  return x_BxLx.sum(axis=(0, 1))


@dataclasses.dataclass(frozen=True)
class Slots:
  """What a strategy may plug into the model.

  attention(q_BxLxNxH, k_BxLxKxH, v_BxLxKxH, segment_ids_BxL=None, window=0) -> out_BxLxNxH:
    causal grouped-query attention over the sequence (inside each packed
    document; over the last `window` tokens when > 0), whatever splits its
    length; the default sees it whole.
  experts(x_BxLxD, expert_BxLxK, weight_BxLxK, w_gate, w_up, w_down) -> y_BxLxD:
    the routed experts on the tokens that chose them, by a grouped GEMM of the
    strategy's choosing (`parallel/experts.py`); the default runs every expert
    here, tiled.
  token_sum(x_BxLx...) -> x...: a per-token count summed over every token of
    the batch (the MoE balance, the multi-token prediction's loss sums); the
    default sums the [batch, length] it sees.
  count_before(x_BxLxE) -> (before_BxLxE, length): per token, the sum of x
    over the earlier positions of its sequence, and the sequence's length (an
    expert's capacity), whatever splits or orders the length it sees.
  aux_loss_weight: how much one forward's auxiliary losses weigh in the step's
    loss (a pipeline runs M forwards a step, each weighing 1/M).
  layer_weights(weights) -> weights: one layer's weights, as its layer runs
    (offload brings them from the host here), run again in the layer's
    backward rather than kept; None: the weights as they are.
  """
  attention: Callable[..., jax.Array] = attention.causal_attention
  experts: Callable[..., jax.Array] = experts.grouped_experts
  token_sum: Callable[[jax.Array], jax.Array] = _batch_sum
  count_before: Callable[[jax.Array], tuple[jax.Array, int]] = sequence.count_before
  aux_loss_weight: float = 1.0
  layer_weights: Callable[[Any], Any] | None = None


class Attention(nnx.Module):

  def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs,
               attend: Callable[..., jax.Array] = attention.causal_attention):
    d, n, k, h = cfg.embed_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    self.cfg, self.attend = cfg, attend
    self.wq_DxNxH = param(rngs, (d, n, h), (r.EMBED, r.HEADS, r.HEAD_DIM), d)
    self.wk_DxKxH = param(rngs, (d, k, h), (r.EMBED, r.KV_HEADS, r.HEAD_DIM), d)
    self.wv_DxKxH = param(rngs, (d, k, h), (r.EMBED, r.KV_HEADS, r.HEAD_DIM), d)
    self.wo_NxHxD = param(rngs, (n, h, d), (r.HEADS, r.HEAD_DIM, r.EMBED), n * h)
    if cfg.qkv_bias:
      self.bq_NxH = zeros((n, h), (r.HEADS, r.HEAD_DIM))
      self.bk_KxH = zeros((k, h), (r.KV_HEADS, r.HEAD_DIM))
      self.bv_KxH = zeros((k, h), (r.KV_HEADS, r.HEAD_DIM))
    if cfg.qk_norm:
      self.q_norm = RMSNorm(h, cfg.norm_eps)
      self.k_norm = RMSNorm(h, cfg.norm_eps)

  def project_qkv(self, x_BxLxD: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """q, k and v before RoPE: the projections, plus their biases (`qkv_bias`),
    q and k normalised per head (`qk_norm`)."""
    q_BxLxNxH, k_BxLxKxH, v_BxLxKxH = self._project(x_BxLxD)
    if self.cfg.qkv_bias:
      q_BxLxNxH, k_BxLxKxH, v_BxLxKxH = (
          y + b[...].astype(y.dtype) for y, b in ((q_BxLxNxH, self.bq_NxH),
                                                  (k_BxLxKxH, self.bk_KxH),
                                                  (v_BxLxKxH, self.bv_KxH)))
    if self.cfg.qk_norm:
      q_BxLxNxH, k_BxLxKxH = self.q_norm(q_BxLxNxH), self.k_norm(k_BxLxKxH)
    return q_BxLxNxH, k_BxLxKxH, v_BxLxKxH

  def _project(self, x_BxLxD: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """q, k, v in one matmul when the kv heads are split like the query heads:
    under tensor parallelism the backward then all-reduces one input gradient,
    not three (Megatron's fused QKV; XLA's CPU compile does not merge the three).
    The query heads of a kv group sit next to each other, so [D, N, H] ->
    [D, K, N/K, H] keeps the head split local."""
    wq, wk, wv = (w[...] for w in (self.wq_DxNxH, self.wk_DxKxH, self.wv_DxKxH))
    rules = dict(flax.core.spmd.get_logical_axis_rules() or ())
    if rules.get(r.KV_HEADS) != rules.get(r.HEADS):  # kv heads whole, query heads split
      return tuple(checkpoint_name(weight_matmul(equation, x_BxLxD, w, float8=self.cfg.float8),
                                   QKV)
                   for equation, w in (("bld,dnh->blnh", wq), ("bld,dkh->blkh", wk),
                                       ("bld,dkh->blkh", wv)))
    (d, n, h), k = wq.shape, wk.shape[1]

    def fuse(wq, wk, wv):
      return jnp.concatenate([wq.reshape(d, k, n // k, h), wk[:, :, None], wv[:, :, None]], 2)

    qkv_BxLxKxGxH = r.constrain(weight_matmul("bld,dkgh->blkgh", x_BxLxD, wq, wk, wv, fuse=fuse,
                                              float8=self.cfg.float8),
                                (r.BATCH, r.LENGTH, r.ACT_KV_HEADS, None, r.HEAD_DIM))
    qkv_BxLxKxGxH = checkpoint_name(qkv_BxLxKxGxH, QKV)
    batch, length = x_BxLxD.shape[:2]
    return (qkv_BxLxKxGxH[:, :, :, :-2].reshape(batch, length, n, h),
            qkv_BxLxKxGxH[:, :, :, -2], qkv_BxLxKxGxH[:, :, :, -1])

  def qkv(self, x_BxLxD: jax.Array,
          positions_BxL: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """q, k and v as the attention takes them: projected, RoPE at `positions_BxL`."""
    cfg = self.cfg
    q_BxLxNxH, k_BxLxKxH, v_BxLxKxH = self.project_qkv(x_BxLxD)
    return (rotary(q_BxLxNxH, positions_BxL, cfg.rope_theta, cfg.rope_scaling),
            rotary(k_BxLxKxH, positions_BxL, cfg.rope_theta, cfg.rope_scaling), v_BxLxKxH)

  def project_out(self, out_BxLxNxH: jax.Array) -> jax.Array:
    """The heads' outputs back to the residual width."""
    return weight_matmul("blnh,nhd->bld", out_BxLxNxH, self.wo_NxHxD[...],
                         float8=self.cfg.float8)

  def __call__(self, x_BxLxD: jax.Array, positions_BxL: jax.Array,
               segment_ids_BxL: jax.Array | None = None) -> jax.Array:
    dtype = x_BxLxD.dtype
    q_BxLxNxH, k_BxLxKxH, v_BxLxKxH = self.qkv(x_BxLxD, positions_BxL)
    q_BxLxNxH = r.constrain(q_BxLxNxH, (r.BATCH, r.LENGTH, r.ACT_HEADS, r.HEAD_DIM))
    k_BxLxKxH = r.constrain(k_BxLxKxH, (r.BATCH, r.LENGTH, r.ACT_KV_HEADS, r.HEAD_DIM))
    v_BxLxKxH = r.constrain(v_BxLxKxH, (r.BATCH, r.LENGTH, r.ACT_KV_HEADS, r.HEAD_DIM))
    if dtype == jnp.float16 and jax.default_backend() == "cpu":
      # jax's float16 attention asks for an F16_F16_F32 dot, which CPU does not lower.
      q_BxLxNxH, k_BxLxKxH, v_BxLxKxH = (x.astype(jnp.float32) for x in
                                          (q_BxLxNxH, k_BxLxKxH, v_BxLxKxH))
    out_BxLxNxH = self.attend(q_BxLxNxH, k_BxLxKxH, v_BxLxKxH, segment_ids_BxL=segment_ids_BxL,
                              window=self.cfg.sliding_window)
    out_BxLxNxH = r.constrain(out_BxLxNxH.astype(dtype),
                              (r.BATCH, r.LENGTH, r.ACT_HEADS, r.HEAD_DIM))
    return checkpoint_name(self.project_out(out_BxLxNxH), ATTN_OUT)


def _latent_matmul(equation: str, x_BxLxD: jax.Array, w_DxR: jax.Array) -> jax.Array:
  """An MLA down-projection to a latent [B, L, R], its weight whole in the
  matmul (gathered again in the backward, as every weight is): left to the
  partitioner, its model width was moved onto `tensor` by collective-permutes,
  which deadlocked inside a pipeline stage's branch (jax 0.10.2, fsdp x tensor)."""
  return r.constrain(weight_matmul(equation, x_BxLxD, w_DxR, fuse=lambda w: r.constrain(
      w, (r.ACT_EMBED, None))), (r.BATCH, r.LENGTH, None))


class LatentAttention(Attention):
  """Multi-head Latent Attention (`mla.py`): q from a normalised query latent
  (or x), k's and v's per-head parts from a normalised key-value latent, one
  rotated key part shared by the heads; then the same attention as
  `Attention`, at the padded width of `mla.widths`. The latent dimensions
  are `latent` (split by `fsdp` where a weight has no `embed` dimension;
  whole under `tensor`, as Megatron keeps MLA's down-projections)."""

  def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs,
               attend: Callable[..., jax.Array] = attention.causal_attention):
    m, d, n = cfg.mla, cfg.embed_dim, cfg.num_heads
    qk, v, _ = mla.widths(cfg)
    self.cfg, self.attend = cfg, attend
    if m.q_lora_rank:
      self.wq_down_DxR = param(rngs, (d, m.q_lora_rank), (r.EMBED, r.LATENT), d)
      self.q_latent_norm = RMSNorm(m.q_lora_rank, cfg.norm_eps)
      self.wq_up_RxNxH = param(rngs, (m.q_lora_rank, n, qk), (r.LATENT, r.HEADS, r.HEAD_DIM),
                               m.q_lora_rank)
    else:
      self.wq_DxNxH = param(rngs, (d, n, qk), (r.EMBED, r.HEADS, r.HEAD_DIM), d)
    self.wkv_down_DxC = param(rngs, (d, m.kv_lora_rank + m.rope_head_dim), (r.EMBED, r.LATENT), d)
    self.kv_latent_norm = RMSNorm(m.kv_lora_rank, cfg.norm_eps)
    self.wkv_up_CxNxH = param(rngs, (m.kv_lora_rank, n, cfg.head_dim + v),
                              (r.LATENT, r.HEADS, r.HEAD_DIM), m.kv_lora_rank)
    self.wo_NxHxD = param(rngs, (n, v, d), (r.HEADS, r.HEAD_DIM, r.EMBED), n * v)

  def _rotate(self, x_BxLxNxR: jax.Array, positions_BxL: jax.Array) -> jax.Array:
    cfg = self.cfg
    return mla.rotary(x_BxLxNxR, positions_BxL, cfg.rope_theta, cfg.rope_scaling,
                      cfg.mla.rope_interleave)

  def query(self, x_BxLxD: jax.Array, positions_BxL: jax.Array) -> jax.Array:
    """q [B, L, N, qk]: each head's [nope | rope] parts, the rope part rotated."""
    cfg, m = self.cfg, self.cfg.mla
    if m.q_lora_rank:
      q_BxLxR = _latent_matmul("bld,dr->blr", x_BxLxD, self.wq_down_DxR[...])
      q_BxLxR = self.q_latent_norm(checkpoint_name(q_BxLxR, QKV))
      q_BxLxNxH = weight_matmul("blr,rnh->blnh", q_BxLxR, self.wq_up_RxNxH[...],
                                float8=cfg.float8)
    else:
      q_BxLxNxH = weight_matmul("bld,dnh->blnh", x_BxLxD, self.wq_DxNxH[...], float8=cfg.float8)
    q_BxLxNxH = checkpoint_name(q_BxLxNxH, QKV)
    return jnp.concatenate([q_BxLxNxH[..., :cfg.head_dim],
                            self._rotate(q_BxLxNxH[..., cfg.head_dim:], positions_BxL)], axis=-1)

  def latent(self, x_BxLxD: jax.Array, positions_BxL: jax.Array) -> tuple[jax.Array, jax.Array]:
    """What a token keeps for every head's key and value: the normalised
    key-value latent [B, L, kv_lora_rank] and the rotated shared key part
    [B, L, rope_head_dim]."""
    m = self.cfg.mla
    kv_BxLxC = checkpoint_name(_latent_matmul("bld,dc->blc", x_BxLxD, self.wkv_down_DxC[...]),
                               QKV)
    k_rope_BxLx1xR = self._rotate(kv_BxLxC[..., None, m.kv_lora_rank:], positions_BxL)
    return self.kv_latent_norm(kv_BxLxC[..., :m.kv_lora_rank]), k_rope_BxLx1xR[..., 0, :]

  def qkv(self, x_BxLxD: jax.Array,
          positions_BxL: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    cfg = self.cfg
    qk, _, width = mla.widths(cfg)
    q_BxLxNxH = self.query(x_BxLxD, positions_BxL)
    c_BxLxC, k_rope_BxLxR = self.latent(x_BxLxD, positions_BxL)
    kv_BxLxNxH = checkpoint_name(weight_matmul("blc,cnh->blnh", c_BxLxC, self.wkv_up_CxNxH[...],
                                               float8=cfg.float8), QKV)
    k_BxLxNxH = jnp.concatenate([kv_BxLxNxH[..., :cfg.head_dim], jnp.broadcast_to(
        k_rope_BxLxR[:, :, None], (*kv_BxLxNxH.shape[:3], k_rope_BxLxR.shape[-1]))], axis=-1)
    scale = mla.query_scale(qk, width, cfg.rope_scaling)
    return (mla.pad_to(q_BxLxNxH * jnp.asarray(scale, q_BxLxNxH.dtype), width),
            mla.pad_to(k_BxLxNxH, width), mla.pad_to(kv_BxLxNxH[..., cfg.head_dim:], width))

  def absorbed_attention(self, q_BxSxNxH: jax.Array, c_BxTxC: jax.Array,
                         k_rope_BxTxR: jax.Array, visible_BxSxT: jax.Array) -> jax.Array:
    """Attention of `query`'s q over T tokens' `latent`s, the key and value
    up-projections absorbed into the query and the output (DeepSeek's
    inference form): the values of expanding the latents to keys and values,
    without holding them. Returns [B, S, N, v_head_dim]."""
    cfg = self.cfg
    qk = mla.widths(cfg)[0]
    w_CxNxH = self.wkv_up_CxNxH[...]
    q_BxSxNxC = weight_matmul("bsnh,cnh->bsnc", q_BxSxNxH[..., :cfg.head_dim],
                              w_CxNxH[..., :cfg.head_dim])
    scores_BxNxSxT = (
        jnp.einsum("bsnc,btc->bnst", q_BxSxNxC, c_BxTxC, preferred_element_type=jnp.float32)
        + jnp.einsum("bsnr,btr->bnst", q_BxSxNxH[..., cfg.head_dim:], k_rope_BxTxR,
                     preferred_element_type=jnp.float32)
    ) * (mla.query_scale(qk, qk, cfg.rope_scaling) / math.sqrt(qk))
    # A finite floor: a padding row sees no slot, and its uniform weights must
    # not meet a NaN from a slot no real row reads.
    scores_BxNxSxT = jnp.where(visible_BxSxT[:, None], scores_BxNxSxT,
                               jnp.finfo(jnp.float32).min)
    probs_BxNxSxT = jax.nn.softmax(scores_BxNxSxT, axis=-1).astype(c_BxTxC.dtype)
    out_BxSxNxC = jnp.einsum("bnst,btc->bsnc", probs_BxNxSxT, c_BxTxC)
    return weight_matmul("bsnc,cnh->bsnh", out_BxSxNxC, w_CxNxH[..., cfg.head_dim:])

  def project_out(self, out_BxLxNxH: jax.Array) -> jax.Array:
    v = self.cfg.mla.v_head_dim
    return weight_matmul("blnh,nhd->bld", out_BxLxNxH[..., :v], self.wo_NxHxD[...],
                         float8=self.cfg.float8)


class Block(nnx.Module):
  """Pre-norm residual block: x + attn(norm(x)), then + mlp(norm(x)); the MLP
  routed (`moe`) or dense."""

  def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs, slots: Slots = Slots(), moe: bool = False):
    self.attn_norm = RMSNorm(cfg.embed_dim, cfg.norm_eps)
    self.attn = (LatentAttention if cfg.mla.kv_lora_rank else Attention)(cfg, rngs,
                                                                         slots.attention)
    self.mlp_norm = RMSNorm(cfg.embed_dim, cfg.norm_eps)
    if moe:
      moe_layers = cfg.num_layers - cfg.moe.first_dense_layers + cfg.mtp_layers
      self.mlp = MoE(cfg.embed_dim, cfg.mlp_dim, cfg.moe, rngs, slots.experts, slots.token_sum,
                     slots.aux_loss_weight / moe_layers, slots.count_before)
    else:
      self.mlp = MLP(cfg.embed_dim, cfg.mlp_dim, rngs, cfg.float8)

  def forward(self, x_BxLxD: jax.Array, positions_BxL: jax.Array,
              segment_ids_BxL: jax.Array | None = None) -> tuple[jax.Array, dict | None]:
    """The block's output and, where the MLP is routed, its routing counts."""
    residual = (r.BATCH, r.RES_LENGTH, r.ACT_EMBED)
    x_BxLxD = r.constrain(
        x_BxLxD + self.attn(self.attn_norm(x_BxLxD), positions_BxL, segment_ids_BxL), residual)
    if isinstance(self.mlp, MoE):
      y_BxLxD, stats = self.mlp.forward(self.mlp_norm(x_BxLxD))
      stats = stats._asdict()
    else:
      y_BxLxD, stats = self.mlp(self.mlp_norm(x_BxLxD)), None
    return r.constrain(x_BxLxD + y_BxLxD, residual), stats

  def __call__(self, x_BxLxD: jax.Array, positions_BxL: jax.Array,
               segment_ids_BxL: jax.Array | None = None) -> jax.Array:
    return self.forward(x_BxLxD, positions_BxL, segment_ids_BxL)[0]


WEIGHT_MATMULS = (QKV, ATTN_OUT, MLP_IN, MLP_OUT)
REMAT_POLICIES = {
    "full": jax.checkpoint_policies.nothing_saveable,
    # Keep the outputs of the weight matmuls (named above); recompute norms,
    # rotary, attention and SwiGLU's product. Korthikanti et al.'s selective
    # recomputation recomputes only attention.
    "selective": jax.checkpoint_policies.save_only_these_names(*WEIGHT_MATMULS),
    # The same outputs, kept in pinned host memory: copied there as each layer's
    # forward runs and back as its backward runs; the rest is recomputed.
    "offload": jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=(), names_which_can_be_offloaded=WEIGHT_MATMULS,
        offload_src="device", offload_dst="pinned_host"),
}
# `remat="none"` where the layer weights are fetched (`Slots.layer_weights`):
# every matmul's output and every named value is kept, and what the fetch and
# the elementwise ops compute is recomputed, so the backward fetches each
# layer's weights again instead of keeping every layer's on the device.
FETCHED_WEIGHTS_POLICY = jax.checkpoint_policies.save_from_both_policies(
    jax.checkpoint_policies.dots_saveable, jax.checkpoint_policies.save_any_names_but_these())


class Embed(nnx.Module):

  def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
    self.dtype = jnp.dtype(cfg.compute_dtype)
    self.reused = cfg.tie_embeddings or cfg.mtp_layers > 0  # the head or the modules use it too
    self.embedding_VxD = param(rngs, (cfg.vocab_size, cfg.embed_dim), (r.VOCAB, r.EMBED),
                               cfg.embed_dim)

  def table(self) -> jax.Array:
    """The table in its compute layout (`embed` whole, like every weight in a
    matmul): a lookup in a table split along `embed` makes GSPMD reshuffle the
    looked-up rows through a full replication instead. Used again (tied to the
    head, or looking up the multi-token prediction's tokens ahead), its
    gradient is pinned back to the table's own layout (`rules.gathered`):
    left in this one, XLA all-reduced the uses' gradients whole, each, over
    the axes that split the table, where a reduce-scatter does
    (tests/test_plan.py, tests/test_mtp.py)."""
    w_VxD = self.embedding_VxD[...]
    if self.reused:
      return r.gathered(w_VxD, (r.VOCAB, r.ACT_EMBED), (r.VOCAB, r.EMBED))
    return r.constrain(w_VxD, (r.VOCAB, r.ACT_EMBED))

  def __call__(self, tokens_BxL: jax.Array) -> jax.Array:
    """The rows of `tokens_BxL`, looked up along the whole of each device's
    length and then split as the residual stream is (Megatron-SP's
    vocabulary-parallel embedding: a reduce-scatter forward, an all-gather of
    the rows' gradient backward). Looked up in the residual's split, XLA
    moved the table and its whole gradient over `tensor`, or rows by
    collective-permutes, by their sizes (docs/tensor.md)."""
    x_BxLxD = r.constrain(self.table()[tokens_BxL].astype(self.dtype),
                          (r.BATCH, r.LENGTH, r.ACT_EMBED))
    return r.constrain(x_BxLxD, (r.BATCH, r.RES_LENGTH, r.ACT_EMBED))


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
      self.head_DxV = param(rngs, (cfg.embed_dim, cfg.vocab_size), (r.EMBED, r.VOCAB),
                            cfg.embed_dim)

  def __call__(self, x_BxLxD: jax.Array, tied_VxD: jax.Array | None = None) -> jax.Array:
    return self.project(self.final_norm(x_BxLxD), tied_VxD)

  def project(self, x_BxLxD: jax.Array, tied_VxD: jax.Array | None = None) -> jax.Array:
    """The output projection alone, of a normalised `x_BxLxD`."""
    head_DxV = tied_VxD.T if tied_VxD is not None else self.head_DxV[...]
    logits_BxLxV = vocab_logits(x_BxLxD, head_DxV.astype(x_BxLxD.dtype))
    return r.constrain(logits_BxLxV, (r.BATCH, r.LENGTH, r.ACT_VOCAB))


def stacked_blocks(cfg: LlamaConfig, rngs: nnx.Rngs, slots: Slots = Slots(),
                   num_layers: int | None = None, moe: bool = False,
                   axis_name: str | None = r.LAYERS) -> Block:
  """`num_layers` (default all) blocks whose weights carry a leading axis named
  `axis_name` (`layers`, which the pipeline splits; None for the leading dense
  layers of an MoE model, which stage 0 runs whole)."""
  @nnx.split_rngs(splits=num_layers or cfg.num_layers)
  @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: axis_name})
  def create(rngs: nnx.Rngs) -> Block:
    return Block(cfg, rngs, slots, moe)
  return create(rngs)


def run_layers(layers: Block, x_BxLxD: jax.Array, positions_BxL: jax.Array | None = None,
               remat: Remat = "none", segment_ids_BxL: jax.Array | None = None,
               layer_weights: Callable[[Any], Any] | None = None
               ) -> tuple[jax.Array, dict | None]:
  """Runs stacked blocks (any number: the whole model or a pipeline chunk) with
  one `lax.scan`, recomputing activations by the `remat` policy; with
  `segment_ids_BxL`, attention stays inside each packed document. Positions
  default to `default_positions`; each layer's weights pass through
  `layer_weights` (`Slots.layer_weights`) as it runs, forward and again in
  its backward. The recomputation takes no optimisation barrier (the scan
  keeps the forward and the backward apart), so XLA may prefetch each layer's
  gathered weights under the previous layer. Returns the output and the
  routed layers' counts stacked over the layers (None for dense ones)."""
  if positions_BxL is None:
    positions_BxL = default_positions(x_BxLxD, segment_ids_BxL)
  graphdef, layer_state = nnx.split(layers)

  def layer(x_BxLxD, state):
    block = nnx.merge(graphdef, state if layer_weights is None else layer_weights(state))
    return block.forward(x_BxLxD, positions_BxL, segment_ids_BxL)

  if remat != "none":
    layer = jax.checkpoint(layer, policy=REMAT_POLICIES[remat], prevent_cse=False)
  elif layer_weights is not None:
    layer = jax.checkpoint(layer, policy=FETCHED_WEIGHTS_POLICY, prevent_cse=False)
  return jax.lax.scan(layer, x_BxLxD, layer_state)


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


class MultiTokenPrediction(nnx.Module):
  """One of DeepSeek-V3's multi-token prediction modules (its report's
  section 2.2; transformers' `MtpLayer`): at each position, the previous
  depth's normalised hidden state and the embedding of the token `depth`
  places ahead, each RMS-normalised, concatenated [embedding | hidden] and
  projected back to the model width, then one more block and an RMSNorm.
  The shared embedding and output head turn its output into the logits of
  the token `depth + 1` places ahead."""

  def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs, slots: Slots = Slots()):
    d = cfg.embed_dim
    self.embed_norm = RMSNorm(d, cfg.norm_eps)
    self.hidden_norm = RMSNorm(d, cfg.norm_eps)
    self.proj_2DxD = param(rngs, (2 * d, d), (None, r.EMBED), 2 * d)
    self.block = Block(cfg, rngs, slots, moe=cfg.moe.num_experts > 0)
    self.norm = RMSNorm(d, cfg.norm_eps)

  def forward(self, h_BxLxD: jax.Array, e_BxLxD: jax.Array, positions_BxL: jax.Array,
              segment_ids_BxL: jax.Array | None = None) -> tuple[jax.Array, dict | None]:
    """This depth's normalised hidden state from the previous depth's
    (`h_BxLxD`) and the embeddings of the tokens it sees (`e_BxLxD`), and its
    block's routing counts."""
    x_BxLx2D = jnp.concatenate([self.embed_norm(e_BxLxD), self.hidden_norm(h_BxLxD)], axis=-1)
    x_BxLxD = r.constrain(weight_matmul("ble,ed->bld", x_BxLx2D, self.proj_2DxD[...]),
                          (r.BATCH, r.RES_LENGTH, r.ACT_EMBED))
    x_BxLxD, stats = self.block.forward(x_BxLxD, positions_BxL, segment_ids_BxL)
    return self.norm(x_BxLxD), stats


class Llama(nnx.Module):

  def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs, slots: Slots = Slots()):
    self.cfg, self.slots = cfg, slots
    moe = cfg.moe.num_experts > 0
    dense = cfg.moe.first_dense_layers if moe else 0
    self.embed = Embed(cfg, rngs)
    self.dense_layers = stacked_blocks(cfg, rngs, slots, dense, axis_name=None) if dense else None
    self.layers = stacked_blocks(cfg, rngs, slots, cfg.num_layers - dense, moe)
    self.head = Head(cfg, rngs)
    if cfg.mtp_layers:
      @nnx.split_rngs(splits=cfg.mtp_layers)
      @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: None})
      def create(rngs: nnx.Rngs) -> MultiTokenPrediction:
        return MultiTokenPrediction(cfg, rngs, slots)
      self.mtp = create(rngs)

  def hidden(self, tokens_BxL: jax.Array, segment_ids: jax.Array | None = None,
             positions: jax.Array | None = None) -> tuple[jax.Array, dict | None]:
    """The last block's output [batch, length, embed] (before the final
    norm) and the routed layers' counts, as `forward` describes them."""
    x_BxLxD = self.embed(tokens_BxL)
    run = functools.partial(run_layers, positions_BxL=positions, remat=self.cfg.remat,
                            segment_ids_BxL=segment_ids, layer_weights=self.slots.layer_weights)
    if self.dense_layers is not None:
      x_BxLxD, _ = run(self.dense_layers, x_BxLxD)
    return run(self.layers, x_BxLxD)

  def forward(self, tokens_BxL: jax.Array, segment_ids: jax.Array | None = None,
              positions: jax.Array | None = None) -> tuple[jax.Array, dict | None]:
    """Float32 logits [batch, length, vocab], one per token in the order
    given, and the routed layers' counts (`moe.Stats` fields stacked over
    the layers; None for a dense model). Packed documents: `segment_ids`
    [batch, length] (0 = padding) keep attention inside each document;
    `positions` (rotary; by default each token's index inside its document)
    restart there."""
    x_BxLxD, stats = self.hidden(tokens_BxL, segment_ids, positions)
    return self.head(x_BxLxD, self.embed.table() if self.cfg.tie_embeddings else None), stats

  def forward_mtp(self, tokens_BxL: jax.Array, ahead_BxLxK: jax.Array,
                  segment_ids: jax.Array | None = None, positions: jax.Array | None = None
                  ) -> tuple[jax.Array, list[jax.Array], dict | None]:
    """`forward`'s logits, the multi-token prediction modules' (`predict_ahead`)
    and the counts of every routed layer, the modules' after the model's."""
    if positions is None:
      positions = default_positions(tokens_BxL, segment_ids)
    x_BxLxD, stats = self.hidden(tokens_BxL, segment_ids, positions)
    logits_BxLxV, mtp_logits, mtp_stats = predict_ahead(
        self.embed, self.head, self.mtp, self.cfg, x_BxLxD, ahead_BxLxK, positions, segment_ids)
    return logits_BxLxV, mtp_logits, None if stats is None else after_layers(stats, mtp_stats)

  def __call__(self, tokens_BxL: jax.Array, segment_ids: jax.Array | None = None,
               positions: jax.Array | None = None) -> jax.Array:
    """The logits of `forward`."""
    return self.forward(tokens_BxL, segment_ids, positions)[0]


def predict_ahead(embed: Embed, head: Head, mtp: MultiTokenPrediction, cfg: LlamaConfig,
                  x_BxLxD: jax.Array, ahead_BxLxK: jax.Array, positions_BxL: jax.Array,
                  segment_ids_BxL: jax.Array | None = None
                  ) -> tuple[jax.Array, list[jax.Array], dict | None]:
  """From the last block's output `x_BxLxD`: the model's logits, the K =
  `mtp_layers` stacked `mtp` modules' (each [batch, length, vocab]: depth k's
  at position i predict the token k + 1 places after it) and the modules'
  routing counts stacked over them (None for dense ones). `ahead_BxLxK[:, i,
  k - 1]` is the token k places after position i (`loss.mtp_batch`), so
  nothing here shifts along the length, whatever order or split it comes in."""
  graphdef, mtp_state = nnx.split(mtp)

  def depth(k, state, h_BxLxD, ahead_BxL):
    module = nnx.merge(graphdef, jax.tree.map(lambda w: w[k], state))
    return module.forward(h_BxLxD, embed(ahead_BxL), positions_BxL, segment_ids_BxL)

  if cfg.remat != "none":
    # Module k's weights are sliced inside the recomputed function, so that
    # its backward slices them again rather than keeping the slices.
    depth = jax.checkpoint(depth, policy=REMAT_POLICIES[cfg.remat], static_argnums=(0,))
  # A loop, not a scan: differentiated, a scan stacks the residuals of an
  # expert exchange nested in the pipeline's shard_map, which Shardy refuses.
  normed_BxLxD = head.final_norm(x_BxLxD)
  h_BxLxD, hidden, stats = normed_BxLxD, [], []
  for k in range(cfg.mtp_layers):
    h_BxLxD, counts = depth(k, mtp_state, h_BxLxD, ahead_BxLxK[..., k])
    hidden.append(h_BxLxD)
    stats.append(counts)
  tied_VxD = embed.table() if cfg.tie_embeddings else None
  return (head.project(normed_BxLxD, tied_VxD),
          [head.project(h, tied_VxD) for h in hidden],
          None if stats[0] is None else jax.tree.map(lambda *x: jnp.stack(x), *stats))


def after_layers(stats: dict, more: dict | None, axis: int = 0) -> dict:
  """Counts stacked over routed layers (along `axis`) followed by `more`'s
  (the multi-token prediction modules'); a count only `more` has, as it is."""
  more = more or {}
  return {**more, **{key: jnp.concatenate([x, more[key]], axis) if key in more else x
                     for key, x in stats.items()}}
