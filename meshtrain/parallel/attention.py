"""Attention on one device's view of the sequence: the mask (causal, and inside
one document when packed) and XLA attention that keeps what its backward needs
once, in the compute dtype.

`jax.nn.dot_product_attention`'s XLA path keeps the float32 scores, the float32
softmax and its compute-dtype copy, and the mask for the backward: 11 bytes per
score in bfloat16, about 350 sbh per llama_8b layer at 4096 tokens. Here the
backward gets the probabilities once, in the compute dtype (2 bytes per
score), and derives the softmax gradient from them, as Megatron's fused softmax
does. In float32 the two are the same computation.
"""

import functools
import math
from collections.abc import Callable

import flax.core.spmd
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from meshtrain import rules as r
from meshtrain.errors import ConfigError

IMPLEMENTATIONS = ("xla", "cudnn")


def flash_fits(head_width: int) -> bool:
  """Whether cuDNN's flash attention takes heads `head_width` wide: a multiple
  of 8 up to 128."""
  return head_width % 8 == 0 and head_width <= 128


def implementation_for(requested: str, compute_dtype: str, head_dim: int, device: jax.Device,
                       packed: bool = False) -> str:
  """What `attention.implementation=""` (the best available) means on `device`.

  XLA's attention stores the [batch, heads, length, length] probabilities for
  the backward. cuDNN's flash attention stores none and is the faster kernel,
  where it runs: NVIDIA GPUs, 16-bit activations, a head_dim that is a
  multiple of 8 up to 128, and no packed documents (`packed`: jax 0.10 gives
  it no segment ids).
  """
  if requested:
    return requested
  flash = (device.platform == "gpu" and device.device_kind.startswith("NVIDIA")
           and compute_dtype in ("bfloat16", "float16") and flash_fits(head_dim) and not packed)
  return "cudnn" if flash else "xla"


def causal_mask(q_index_T: jax.Array, k_index_S: jax.Array, q_segment_BxT: jax.Array | None = None,
                k_segment_BxS: jax.Array | None = None, window: int = 0) -> jax.Array:
  """[B or 1, T, S]: query t sees key s when s comes no later (by index in the
  whole sequence), with a `window` > 0 less than `window` tokens earlier
  (Mistral's sliding window: itself and the window - 1 before it), and, with
  segment ids, belongs to the same document. Padding (segment 0) sees only
  padding, so no row is empty."""
  mask_1xTxS = (k_index_S[None, :] <= q_index_T[:, None])[None]
  if window:
    mask_1xTxS &= (k_index_S[None, :] > q_index_T[:, None] - window)[None]
  if q_segment_BxT is None:
    return mask_1xTxS
  return mask_1xTxS & (q_segment_BxT[:, :, None] == k_segment_BxS[:, None, :])


@jax.custom_vjp
def masked_attention(q_BxTxNxH: jax.Array, k_BxSxKxH: jax.Array, v_BxSxKxH: jax.Array,
                     mask_BxTxS: jax.Array) -> jax.Array:
  """softmax(q k^T / sqrt(H), where mask) v for grouped-query heads (N a
  multiple of K; query head n uses kv head n // (N / K)). The mask's batch may
  be 1 (broadcast); every row needs one visible key. Scores and softmax in
  float32, the output in q's dtype."""
  return _attention_fwd(q_BxTxNxH, k_BxSxKxH, v_BxSxKxH, mask_BxTxS)[0]


def _grouped(q_BxTxNxH: jax.Array, num_kv_heads: int) -> jax.Array:
  b, t, n, h = q_BxTxNxH.shape
  return q_BxTxNxH.reshape(b, t, num_kv_heads, n // num_kv_heads, h)


def _attention_fwd(q_BxTxNxH, k_BxSxKxH, v_BxSxKxH, mask_BxTxS):
  dtype = q_BxTxNxH.dtype
  scale = q_BxTxNxH.shape[-1] ** -0.5
  q_BxTxKxGxH = _grouped(q_BxTxNxH, k_BxSxKxH.shape[2])
  s_BxKxGxTxS = jnp.einsum("btkgh,bskh->bkgts", q_BxTxKxGxH, k_BxSxKxH,
                           preferred_element_type=jnp.float32) * scale
  s_BxKxGxTxS = jnp.where(mask_BxTxS[:, None, None], s_BxKxGxTxS, jnp.finfo(jnp.float32).min)
  p_BxKxGxTxS = jax.nn.softmax(s_BxKxGxTxS, axis=-1).astype(dtype)
  out_BxTxKxGxH = jnp.einsum("bkgts,bskh->btkgh", p_BxKxGxTxS, v_BxSxKxH,
                             preferred_element_type=jnp.float32)
  out_BxTxNxH = out_BxTxKxGxH.reshape(q_BxTxNxH.shape).astype(dtype)
  return out_BxTxNxH, (q_BxTxNxH, k_BxSxKxH, v_BxSxKxH, p_BxKxGxTxS)


def _attention_bwd(residuals, g_BxTxNxH):
  q_BxTxNxH, k_BxSxKxH, v_BxSxKxH, p_BxKxGxTxS = residuals
  dtype = q_BxTxNxH.dtype
  scale = q_BxTxNxH.shape[-1] ** -0.5
  num_kv_heads = k_BxSxKxH.shape[2]
  g_BxTxKxGxH = _grouped(g_BxTxNxH.astype(dtype), num_kv_heads)
  dv_BxSxKxH = jnp.einsum("bkgts,btkgh->bskh", p_BxKxGxTxS, g_BxTxKxGxH,
                          preferred_element_type=jnp.float32)
  dp_BxKxGxTxS = jnp.einsum("btkgh,bskh->bkgts", g_BxTxKxGxH, v_BxSxKxH,
                            preferred_element_type=jnp.float32)
  # Softmax backward: p * (dp - sum(p * dp)); masked keys have p = 0.
  p32_BxKxGxTxS = p_BxKxGxTxS.astype(jnp.float32)
  ds_BxKxGxTxS = (p32_BxKxGxTxS * (dp_BxKxGxTxS - jnp.sum(p32_BxKxGxTxS * dp_BxKxGxTxS, axis=-1,
                                                          keepdims=True)) * scale).astype(dtype)
  dq_BxTxKxGxH = jnp.einsum("bkgts,bskh->btkgh", ds_BxKxGxTxS, k_BxSxKxH,
                            preferred_element_type=jnp.float32)
  dk_BxSxKxH = jnp.einsum("bkgts,btkgh->bskh", ds_BxKxGxTxS, _grouped(q_BxTxNxH, num_kv_heads),
                          preferred_element_type=jnp.float32)
  return (dq_BxTxKxGxH.reshape(q_BxTxNxH.shape).astype(dtype), dk_BxSxKxH.astype(dtype),
          dv_BxSxKxH.astype(dtype), None)


masked_attention.defvjp(_attention_fwd, _attention_bwd)


def all_manual(attend: Callable, q_BxLxNxH: jax.Array, k_BxLxKxH: jax.Array,
               v_BxLxKxH: jax.Array) -> jax.Array:
  """`attend(q, k, v)` with every mesh axis manual around it where some are
  already (Ulysses' shard_map). jax 0.10.2's partitioner
  of cuDNN attention fails on the sharding it gets in a partly manual region
  (it reads `.spec` of a GSPMDSharding: seen in the program XLA's GPU compiler
  builds, docs/gpu_program.md), so the other axes are made manual here too:
  each device attends over its rows of the batch and its heads, the batch
  split as the rules in force split it, the heads over the axes that split
  the query and the kv heads alike (so a query head's kv head is on its
  device), the length whole."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or not mesh.manual_axes:
    return attend(q_BxLxNxH, k_BxLxKxH, v_BxLxKxH)
  rules = flax.core.spmd.get_logical_axis_rules() or ()
  auto = frozenset(a for a in mesh.axis_names if a not in mesh.manual_axes)

  def split(name: str, size: int) -> tuple[str, ...] | None:
    axes = tuple(a for a in jax.tree.leaves(tuple(r.logical_to_spec((name,), rules)))
                 if a in auto and mesh.shape[a] > 1)
    return axes if axes and size % math.prod(mesh.shape[a] for a in axes) == 0 else None

  batch = split(r.BATCH, q_BxLxNxH.shape[0])
  heads, kv_heads = split(r.ACT_HEADS, q_BxLxNxH.shape[2]), split(r.ACT_KV_HEADS,
                                                                   k_BxLxKxH.shape[2])
  spec = P(batch, None, heads if heads == kv_heads else None, None)
  return jax.shard_map(attend, in_specs=(spec,) * 3, out_specs=spec, axis_names=auto)(
      q_BxLxNxH, k_BxLxKxH, v_BxLxKxH)


def causal_attention(q_BxLxNxH: jax.Array, k_BxLxKxH: jax.Array, v_BxLxKxH: jax.Array, *,
                     implementation: str = "xla", segment_ids_BxL: jax.Array | None = None,
                     window: int = 0) -> jax.Array:
  """Causal attention over a whole sequence, inside documents when
  `segment_ids_BxL` is given, over the last `window` tokens when it is > 0
  (`causal_mask`); `implementation` xla (`masked_attention`) or cudnn (flash,
  `jax.nn.dot_product_attention`)."""
  if implementation == "cudnn":
    if segment_ids_BxL is not None:
      raise ConfigError("config.attention.implementation",
                        "cudnn cannot keep packed documents apart here (jax 0.10 passes it no "
                        "segment ids); use 'xla' or config.data.packing='concat'")
    flash = functools.partial(jax.nn.dot_product_attention, is_causal=True,
                              local_window_size=(window - 1, 0) if window else None,
                              implementation="cudnn")
    return all_manual(flash, q_BxLxNxH, k_BxLxKxH, v_BxLxKxH)
  index_L = jnp.arange(q_BxLxNxH.shape[1])
  mask = causal_mask(index_L, index_L, segment_ids_BxL, segment_ids_BxL, window)
  return masked_attention(q_BxLxNxH, k_BxLxKxH, v_BxLxKxH, mask)
