"""Multi-head Latent Attention (DeepSeek-V2 and V3): the options and the
arithmetic that turns its queries, keys and values into ordinary ones.

MLA projects a token to two low-rank latents, RMS-normalises them, and
expands them per head: queries from the query latent (`q_lora_rank`; 0: from
x directly), keys' and values' "nope" parts from the key-value latent
(`kv_lora_rank`). RoPE rotates `rope_head_dim` more dimensions of each query
head and one key part shared by every head, taken from x directly. A query
and key head is [nope | rope] wide (qk = `model.head_dim` + `rope_head_dim`),
a value head `v_head_dim`; the scores are scaled by 1/sqrt(qk), times
DeepSeek's YaRN mscale_all_dim term squared.

Everything after the projections is meshtrain's attention unchanged (causal,
packed, sliding, each sequence strategy): where qk and
v differ, the narrower side is zero-padded to the wider (zero dimensions
change no score and no output), q is scaled so that the kernel's 1/sqrt(width)
gives MLA's scale, and the output is cut back to `v_head_dim`. Generation
caches the latents instead and absorbs the up-projections
(`LatentAttention.absorbed_attention`).
"""

import dataclasses
import math

import jax
import jax.numpy as jnp

from meshtrain.models import rope


@dataclasses.dataclass(frozen=True)
class MLAConfig:
  kv_lora_rank: int = 0      # the key-value latent's width; 0: grouped-query attention, not MLA
  q_lora_rank: int = 0       # the query latent's width; 0: queries projected from x
  rope_head_dim: int = 64    # the rotated dimensions of a query head and of the shared key part
  v_head_dim: int = 128
  rope_interleave: bool = True  # RoPE on interleaved pairs (DeepSeek's checkpoints), else halves


def widths(model) -> tuple[int, int, int]:
  """(qk, v, attention) head widths of `model` (`config.model` or a
  LlamaConfig): MLA's query-key and value widths and the padded width the
  attention runs at, or its head_dim three times without MLA."""
  head_dim, mla = model.head_dim, model.mla
  if not mla.kv_lora_rank:
    return head_dim, head_dim, head_dim
  qk = head_dim + mla.rope_head_dim
  return qk, mla.v_head_dim, max(qk, mla.v_head_dim)


def query_scale(qk: int, width: int,
                scaling: rope.Llama3Scaling | rope.YarnScaling | None) -> float:
  """The factor on q that turns the kernel's 1/sqrt(width) into MLA's
  1/sqrt(qk), times DeepSeek's mscale_all_dim term squared under YaRN."""
  mscale = (rope.yarn_mscale(scaling.factor, scaling.mscale_all_dim)
            if isinstance(scaling, rope.YarnScaling) and scaling.mscale_all_dim else 1.0)
  return math.sqrt(width / qk) * mscale**2


def pad_to(x_BxLxNxH: jax.Array, width: int) -> jax.Array:
  """x with zeros appended to its last dimension up to `width`."""
  extra = width - x_BxLxNxH.shape[-1]
  return x_BxLxNxH if not extra else jnp.pad(x_BxLxNxH, [(0, 0)] * (x_BxLxNxH.ndim - 1)
                                              + [(0, extra)])


def rotary(x_BxLxNxR: jax.Array, positions_BxL: jax.Array, theta: float, scaling,
           interleave: bool) -> jax.Array:
  """RoPE on MLA's rotated dimensions; with `interleave`, on the pairs (x0,
  x1), (x2, x3), ... as DeepSeek's checkpoints lay them out. Its output is in
  rotate-half order either way (as transformers' is); q and k share it, so
  their scores are those of the interleaved rotation."""
  if interleave:
    x_BxLxNxR = jnp.concatenate([x_BxLxNxR[..., 0::2], x_BxLxNxR[..., 1::2]], axis=-1)
  return rope.rotary(x_BxLxNxR, positions_BxL, theta, scaling)
