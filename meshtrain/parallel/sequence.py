"""Context-parallel causal attention: the `length` of activations is sharded
over one mesh axis (`sequence`), and attention needs every earlier token.

Three ways to bring keys and values to the queries:

  all_gather_kv  all-gather K and V; each shard attends its queries to the
                 prefix. Simple; K/V memory grows with the whole length, and
                 the last shard does the most work.
  ulysses        all-to-all from length to head sharding, whole-length
                 attention on the local heads, all-to-all back. Needs the
                 query heads divisible by the axis size.
  ring           K/V blocks travel around the ring (`ppermute`) while an
                 online softmax accumulates in float32. Causal load balance:
                 tokens lie zigzag (device i holds chunks i and 2n-1-i of
                 2n), so every device does the same work.

Contract of `sequence_attention`: equal to `attention.causal_attention` on the
whole sequence, for q, k, v of any batch (data/fsdp) and head (tensor)
sharding, which stay as they are. Outside a shard_map it opens its own,
manual over the axis and the batch-only axes; inside one that is already
manual over the axis (the pipeline's) it works on the local shards and makes
the collectives itself. On a mesh where the axis is absent or of size 1 it is
`causal_attention`. With `zigzag=True` (ring only) the caller's tokens are
already in `zigzag_order`: a model fed its batch in that order (`to_zigzag`,
positions included) runs every layer without re-laying q, k, v and the
output, and a mean loss over tokens needs no reordering back. Rotary
positions are applied by the caller.

Packed documents (`segment_ids_BxL`, 0 = padding): every strategy masks keys
of other documents. The ids follow q's layout; all_gather_kv and ulysses see
them whole, ring passes them around with K and V.

Why the shard_maps are shaped as they are (which collective the partitioner
or the kernel makes, `check_vma` off, the batch axes taken manual) is in
docs/context_parallel.md.
"""

import functools
import math

import flax.core.spmd
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, PartitionSpec as P

from meshtrain import rules as r
from meshtrain.parallel import attention

STRATEGIES = ("all_gather_kv", "ulysses", "ring")
FREE = P.UNCONSTRAINED
ROW_AXES = ("data", "fsdp")  # mesh axes that split activations only along the batch


def _split(mesh: Mesh, axis: str, batch_size: int) -> tuple[set[str], tuple[str, ...] | None]:
  """The axes a shard_map here takes manual, and the spec of the batch
  dimension: the row axes the batch is split over (by the active logical rules;
  without rules, all that divide it). A row axis the rules leave out is the one
  a vmap maps over, and the vmap puts it on its own dimension."""
  rows = tuple(a for a in ROW_AXES if a != axis and mesh.shape.get(a, 1) > 1
               and a not in mesh.manual_axes)
  rules = dict(flax.core.spmd.get_logical_axis_rules() or ())
  batch = tuple(a for a in rules.get(r.BATCH, rows) if a in rows) if rules else rows
  if batch_size % math.prod(mesh.shape[a] for a in batch):
    batch = ()
  return {axis, *rows}, batch or None


def sequence_attention(q_BxLxNxH: jax.Array, k_BxLxKxH: jax.Array, v_BxLxKxH: jax.Array, *,
                       strategy: str, mesh: Mesh | None = None, axis: str = "sequence",
                       zigzag: bool = False, segment_ids_BxL: jax.Array | None = None,
                       window: int = 0, implementation: str = "xla") -> jax.Array:
  """Causal grouped-query attention over a length sharded on `axis`; equal to
  `attention.causal_attention(q, k, v, segment_ids_BxL=..., window=...)` on
  the whole sequence (a sliding `window` under all_gather_kv and ulysses, not
  the ring). With `zigzag` (ring only) q, k, v, the segment ids and the output
  are in `to_zigzag` order. `mesh` defaults to the one in context
  (`jax.set_mesh`). `implementation` is the kernel of attention over a whole
  length (`attention.causal_attention`): of one device, and of ulysses' local
  heads (cuDNN's flash attention keeps their scores on chip); all_gather_kv's
  local queries and the ring's blocks run XLA's masked attention."""
  if strategy not in STRATEGIES:
    raise ValueError(f"unknown sequence attention strategy {strategy!r}; "
                     f"choose one of {', '.join(STRATEGIES)}")
  if zigzag and strategy != "ring":
    raise ValueError(f"only the ring strategy takes the zigzag layout, not {strategy!r}")
  if window and strategy == "ring":
    raise ValueError("the ring has no sliding window; use all_gather_kv or ulysses")
  _, length, num_heads, _ = q_BxLxNxH.shape
  num_kv_heads = k_BxLxKxH.shape[2]
  if num_heads % num_kv_heads:
    raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads} kv heads")
  mesh = jax.sharding.get_abstract_mesh() if mesh is None else mesh
  n = 1 if mesh.empty else mesh.shape.get(axis, 1)
  if n == 1:  # zigzag order on one device is the natural one
    return attention.causal_attention(q_BxLxNxH, k_BxLxKxH, v_BxLxKxH,
                                      implementation=implementation,
                                      segment_ids_BxL=segment_ids_BxL, window=window)
  check_split(strategy, num_heads, length * n if _is_manual(mesh, axis) else length, n, axis)
  strategy_fn = {"all_gather_kv": functools.partial(_all_gather_kv, window=window),
                 "ulysses": functools.partial(_ulysses, window=window,
                                              implementation=implementation),
                 "ring": functools.partial(_ring, zigzag=zigzag)}[strategy]
  return strategy_fn(q_BxLxNxH, k_BxLxKxH, v_BxLxKxH, segment_ids_BxL, mesh=mesh, axis=axis)


def check_split(strategy: str, num_heads: int, length: int, n: int, axis: str = "sequence") -> None:
  """Raises ValueError when `strategy` cannot split `num_heads` query heads and
  `length` tokens over the `n` devices of `axis` (also run up front by
  `meshtrain.validate`, before anything is compiled)."""
  if strategy == "ulysses" and num_heads % n:
    raise ValueError(
        f"ulysses splits the {num_heads} query heads over the {n} devices of mesh axis "
        f"{axis!r}: set num_heads to a multiple of {n} or change mesh.{axis} to a divisor "
        f"of {num_heads} (or use strategy 'ring' or 'all_gather_kv')")
  chunks = 2 * n if strategy == "ring" else n
  if length % chunks:
    raise ValueError(f"strategy {strategy!r} on {n} devices needs the length ({length}) "
                     f"to be a multiple of {chunks}")


def _is_manual(mesh: Mesh, axis: str) -> bool:
  """Whether the caller already runs manual over `axis`: q, k, v are its local shards."""
  return axis in mesh.manual_axes


def _segments(segment_ids_BxL: jax.Array | None, *specs: P) -> tuple[tuple, tuple]:
  """The segment ids as extra shard_map arguments, one per spec; none without them."""
  if segment_ids_BxL is None:
    return (), ()
  return (segment_ids_BxL,) * len(specs), specs


def _all_gather_kv(q_BxLxNxH, k_BxLxKxH, v_BxLxKxH, segment_ids_BxL, *, mesh: Mesh, axis: str,
                   window: int):
  """K and V enter the shard_map whole (the partitioner all-gathers them along
  the length); local queries attend to them, masked at this shard's offset."""
  def attend(q_BxTxNxH, k_BxLxKxH, v_BxLxKxH, *segments):
    t = q_BxTxNxH.shape[1]
    q_index_T = lax.axis_index(axis) * t + jnp.arange(t)
    mask = attention.causal_mask(q_index_T, jnp.arange(k_BxLxKxH.shape[1]), *segments,
                                 window=window)
    return attention.masked_attention(q_BxTxNxH, k_BxLxKxH, v_BxLxKxH, mask)

  if _is_manual(mesh, axis):
    gather = functools.partial(lax.all_gather, axis_name=axis, axis=1, tiled=True)
    segments = () if segment_ids_BxL is None else (segment_ids_BxL, gather(segment_ids_BxL))
    return attend(q_BxLxNxH, gather(k_BxLxKxH), gather(v_BxLxKxH), *segments)
  manual, batch = _split(mesh, axis, q_BxLxNxH.shape[0])
  by_length = P(batch, axis)
  segments, segment_specs = _segments(segment_ids_BxL, by_length, P(batch))
  return jax.shard_map(attend, mesh=mesh, in_specs=(by_length, P(batch), P(batch), *segment_specs),
                       out_specs=by_length, axis_names=manual, check_vma=False)(
                           q_BxLxNxH, k_BxLxKxH, v_BxLxKxH, *segments)


def _ulysses(q_BxLxNxH, k_BxLxKxH, v_BxLxKxH, segment_ids_BxL, *, mesh: Mesh, axis: str,
             window: int, implementation: str):
  """Heads enter the shard_map sharded over `axis`: the partitioner swaps length
  for head sharding (an all-to-all) on the way in, and back on the way out.

  kv heads are repeated to R, a multiple of K and n, so that they split evenly
  (query head j still meets kv head j // (N / K)). Heads are split as
  A x S x G = (R / n) x n x (N / R) with `axis` on S: each device gets whole
  query groups with their kv head, and a split of the heads over `tensor` (on
  A, the major factor, where meshtrain's rules put it) stays in place when R is
  a multiple of n * tensor too, which R is chosen to be where N allows.
  """
  b, length, num_heads, h = q_BxLxNxH.shape
  n = mesh.shape[axis]
  tensor = mesh.shape.get("tensor", 1) if axis != "tensor" else 1
  num_kv_heads = k_BxLxKxH.shape[2]
  kv_heads = ulysses_kv_heads(num_heads, num_kv_heads, n, tensor)
  q_BxLxAxSxGxH = q_BxLxNxH.reshape(b, length, kv_heads // n, n, num_heads // kv_heads, h)
  kv = [jnp.repeat(x_BxLxKxH, kv_heads // num_kv_heads, axis=2).reshape(
      b, length, kv_heads // n, n, h) for x_BxLxKxH in (k_BxLxKxH, v_BxLxKxH)]

  def attend(q_BxLxAx1xGxH, k_BxLxAx1xH, v_BxLxAx1xH, *segments):
    out_BxLxNxH = attention.causal_attention(
        q_BxLxAx1xGxH.reshape(*q_BxLxAx1xGxH.shape[:2], -1, h), k_BxLxAx1xH[:, :, :, 0],
        v_BxLxAx1xH[:, :, :, 0], implementation=implementation,
        segment_ids_BxL=segments[0] if segments else None, window=window)
    return out_BxLxNxH.reshape(q_BxLxAx1xGxH.shape)

  if _is_manual(mesh, axis):  # local length in, local heads of the whole length inside
    to_heads = functools.partial(lax.all_to_all, axis_name=axis, split_axis=3, concat_axis=1,
                                 tiled=True)
    segments = () if segment_ids_BxL is None else (
        lax.all_gather(segment_ids_BxL, axis, axis=1, tiled=True),) * 2
    out_BxLxAx1xGxH = attend(to_heads(q_BxLxAxSxGxH), *map(to_heads, kv), *segments)
    return lax.all_to_all(out_BxLxAx1xGxH, axis, split_axis=1, concat_axis=3,
                          tiled=True).reshape(b, length, num_heads, h)
  # Pinned to the length split here, or the head split would propagate back
  # through the repeat (and the partitioner would all-gather K and V).
  kv = [lax.with_sharding_constraint(x_BxLxAxSxH, P(FREE, axis, FREE, None, FREE))
        for x_BxLxAxSxH in kv]
  manual, batch = _split(mesh, axis, b)
  by_heads = P(batch, None, None, axis)
  segments, segment_specs = _segments(segment_ids_BxL, P(batch), P(batch))
  out_BxLxAxSxGxH = jax.shard_map(attend, mesh=mesh, in_specs=(by_heads,) * 3 + segment_specs,
                                  out_specs=by_heads, axis_names=manual, check_vma=False)(
                                      q_BxLxAxSxGxH, *kv, *segments)
  out_BxLxAxSxGxH = lax.with_sharding_constraint(
      out_BxLxAxSxGxH, P(FREE, axis, FREE, None, FREE, FREE))
  return out_BxLxAxSxGxH.reshape(b, length, num_heads, h)


def ulysses_kv_heads(num_heads: int, num_kv_heads: int, n: int, tensor: int) -> int:
  """R, the kv heads Ulysses repeats K and V to (see `_ulysses`)."""
  return math.lcm(num_kv_heads, n * tensor if num_heads % (n * tensor) == 0 else n)


def _ring(q_BxLxNxH, k_BxLxKxH, v_BxLxKxH, segment_ids_BxL, *, mesh: Mesh, axis: str,
          zigzag: bool):
  """The zigzag layout buys balance: the busiest device computes (n + 1) / 2
  blocks of T x T scores instead of n in a contiguous ring (the last device
  sees all). From a contiguous layout it costs a second exchange of q, k and v
  and one of the output."""
  shard = functools.partial(_ring_shard, axis=axis, n=mesh.shape[axis], zigzag=zigzag)
  if _is_manual(mesh, axis):
    return shard(q_BxLxNxH, k_BxLxKxH, v_BxLxKxH, segment_ids_BxL)
  manual, batch = _split(mesh, axis, q_BxLxNxH.shape[0])
  by_length = P(batch, axis)
  segments, segment_specs = _segments(segment_ids_BxL, by_length)
  return jax.shard_map(
      shard, mesh=mesh, in_specs=(by_length,) * 3 + segment_specs, out_specs=by_length,
      axis_names=manual, check_vma=False)(q_BxLxNxH, k_BxLxKxH, v_BxLxKxH, *segments)


def _ring_shard(q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, segment_BxT=None, *, axis: str, n: int,
                zigzag: bool):
  """Ring attention on the zigzag layout with an online softmax.

  After `_to_zigzag` device i holds chunks i and 2n-1-i (C tokens each). Its own
  K/V block is the diagonal (position mask). A block from device j != i is then
  either visible to both query chunks but only in its first half (j < i), or
  visible only to the second query chunk (j > i): C x 2C scores either way,
  half a contiguous block, and the same on every device.

  With segment ids, each block also masks keys of other documents (the ids
  travel with K and V); a block may then hide every key from a query, whose
  statistics it leaves alone (p = 0, row max the float32 minimum).
  """
  b, t, num_heads, h = q_BxTxNxH.shape
  num_kv_heads = k_BxTxKxH.shape[2]
  c = t // 2
  i = lax.axis_index(axis)
  # k and v travel as one array (stacked on a new axis, leaving the head split
  # alone): one exchange per ring step, and in the backward one for dk and dv,
  # rather than one per tensor.
  relayout = (lambda x: x) if zigzag else functools.partial(_to_zigzag, axis=axis, n=n)
  q_BxTxKxGxH = relayout(q_BxTxNxH).reshape(b, t, num_kv_heads, num_heads // num_kv_heads, h)
  kv_BxTx2xKxH = relayout(jnp.stack([k_BxTxKxH, v_BxTxKxH], axis=2))
  q_seg_BxT = None if segment_BxT is None else relayout(segment_BxT)

  def attend(q_BxTxKxGxH, kv_BxSx2xKxH, mask_BxTxS, q_seg_BxT, kv_seg_BxS):
    if q_seg_BxT is not None:
      same_BxTxS = q_seg_BxT[:, :, None] == kv_seg_BxS[:, None, :]
      mask_BxTxS = same_BxTxS if mask_BxTxS is None else mask_BxTxS & same_BxTxS
    return _block(q_BxTxKxGxH, kv_BxSx2xKxH[:, :, 0], kv_BxSx2xKxH[:, :, 1], mask_BxTxS)

  chunk_pos_C = jnp.arange(c)
  pos_T = jnp.concatenate([i * c + chunk_pos_C, (2 * n - 1 - i) * c + chunk_pos_C])
  stats = attend(q_BxTxKxGxH, kv_BxTx2xKxH, (pos_T[:, None] >= pos_T[None, :])[None],
                 q_seg_BxT, q_seg_BxT)

  def earlier(stats, kv_BxTx2xKxH, kv_seg_BxT):
    kv_seg_BxC = None if kv_seg_BxT is None else kv_seg_BxT[:, :c]
    return _merge(stats, attend(q_BxTxKxGxH, kv_BxTx2xKxH[:, :c], None, q_seg_BxT, kv_seg_BxC))

  def later(stats, kv_BxTx2xKxH, kv_seg_BxT):
    # Every statistic has the query position on axis 3.
    first, second = zip(*(jnp.split(s, 2, axis=3) for s in stats))
    q_seg_BxC = None if q_seg_BxT is None else q_seg_BxT[:, c:]
    second = _merge(second, attend(q_BxTxKxGxH[:, c:], kv_BxTx2xKxH, None, q_seg_BxC, kv_seg_BxT))
    return tuple(jnp.concatenate(pair, axis=3) for pair in zip(first, second))

  ring = [(d, (d + 1) % n) for d in range(n)]
  kv_seg_BxT = q_seg_BxT
  for step in range(1, n):
    kv_BxTx2xKxH = lax.ppermute(kv_BxTx2xKxH, axis, ring)
    if kv_seg_BxT is not None:
      kv_seg_BxT = lax.ppermute(kv_seg_BxT, axis, ring)
    source = (i - step) % n  # both branches cost the same: devices stay in step
    stats = lax.cond(source < i, earlier, later, stats, kv_BxTx2xKxH, kv_seg_BxT)

  o_BxKxGxTxH, _, l_BxKxGxT = stats
  out_BxKxGxTxH = o_BxKxGxTxH / l_BxKxGxT[..., None]
  out_BxTxNxH = out_BxKxGxTxH.transpose(0, 3, 1, 2, 4).reshape(b, t, num_heads, h).astype(
      q_BxTxNxH.dtype)
  return out_BxTxNxH if zigzag else _from_zigzag(out_BxTxNxH, axis, n)


def _block(q_BxTxKxGxH, k_BxSxKxH, v_BxSxKxH, mask_BxTxS=None):
  """Unnormalized attention of one query block to one K/V block, and its float32
  softmax statistics: (sum of p v, row max, row sum of p). The mask's batch
  may be 1."""
  scale = q_BxTxKxGxH.shape[-1] ** -0.5
  s_BxKxGxTxS = jnp.einsum("btkgh,bskh->bkgts", q_BxTxKxGxH, k_BxSxKxH,
                           preferred_element_type=jnp.float32) * scale
  if mask_BxTxS is not None:
    mask_BxKxGxTxS = mask_BxTxS[:, None, None]
    s_BxKxGxTxS = jnp.where(mask_BxKxGxTxS, s_BxKxGxTxS, jnp.finfo(jnp.float32).min)
  # The output does not depend on the max (its true gradient is zero): stop it.
  m_BxKxGxT = lax.stop_gradient(s_BxKxGxTxS.max(axis=-1))
  p_BxKxGxTxS = jnp.exp(s_BxKxGxTxS - m_BxKxGxT[..., None])
  if mask_BxTxS is not None:  # rows with no visible key: exp(0) = 1 everywhere
    p_BxKxGxTxS = jnp.where(mask_BxKxGxTxS, p_BxKxGxTxS, 0)
  o_BxKxGxTxH = jnp.einsum("bkgts,bskh->bkgth", p_BxKxGxTxS.astype(v_BxSxKxH.dtype), v_BxSxKxH,
                           preferred_element_type=jnp.float32)
  return o_BxKxGxTxH, m_BxKxGxT, p_BxKxGxTxS.sum(axis=-1)


def _merge(a, b):
  """Combines the softmax statistics of two K/V blocks for the same queries."""
  o_a, m_a, l_a = a
  o_b, m_b, l_b = b
  m = jnp.maximum(m_a, m_b)
  scale_a, scale_b = jnp.exp(m_a - m), jnp.exp(m_b - m)
  return (o_a * scale_a[..., None] + o_b * scale_b[..., None], m, l_a * scale_a + l_b * scale_b)


def zigzag_pairs(n: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
  """Where chunk c (held by device c // 2) goes: to device c if c < n, else
  2n-1-c. Even chunks and odd chunks each form a permutation."""
  dest = lambda c: c if c < n else 2 * n - 1 - c  # noqa: E731
  return ([(d, dest(2 * d)) for d in range(n)], [(d, dest(2 * d + 1)) for d in range(n)])


def _permute(x: jax.Array, axis: str, pairs: list[tuple[int, int]]) -> jax.Array:
  """`lax.ppermute`, skipped when it moves nothing (XLA keeps such copies)."""
  return x if all(s == d for s, d in pairs) else lax.ppermute(x, axis, pairs)


def zigzag_order(length: int, n: int) -> np.ndarray:
  """The position of each slot of the zigzag layout on n devices: device i holds
  chunks i and 2n-1-i of 2n (slots i*L/n onwards)."""
  chunks = np.arange(length).reshape(2 * n, length // (2 * n))
  return np.concatenate([chunks[[i, 2 * n - 1 - i]] for i in range(n)]).reshape(length)


def to_zigzag(x_BxL: jax.Array, mesh: Mesh, axis: str = "sequence") -> jax.Array:
  """`x[:, zigzag_order(L, n)]` for any [batch, length, ...] array whose length
  is split over `axis`, in two collective-permutes."""
  manual, batch = _split(mesh, axis, x_BxL.shape[0])
  by_length = P(batch, axis)
  return jax.shard_map(functools.partial(_to_zigzag, axis=axis, n=mesh.shape[axis]), mesh=mesh,
                       in_specs=by_length, out_specs=by_length, axis_names=manual,
                       check_vma=False)(x_BxL)




def _to_zigzag(x_BxTxJxH: jax.Array, axis: str, n: int) -> jax.Array:
  """Contiguous chunks (2i, 2i+1) on device i -> zigzag chunks (i, 2n-1-i)."""
  c = x_BxTxJxH.shape[1] // 2
  even_pairs, odd_pairs = zigzag_pairs(n)
  even = _permute(x_BxTxJxH[:, :c], axis, even_pairs)
  odd = _permute(x_BxTxJxH[:, c:], axis, odd_pairs)
  # Chunk i has the parity of i; chunk 2n-1-i the other one.
  i_is_even = lax.axis_index(axis) % 2 == 0
  return jnp.concatenate([jnp.where(i_is_even, even, odd), jnp.where(i_is_even, odd, even)],
                         axis=1)


def _from_zigzag(x_BxTxJxH: jax.Array, axis: str, n: int) -> jax.Array:
  """The inverse of `_to_zigzag`."""
  c = x_BxTxJxH.shape[1] // 2
  early, late = x_BxTxJxH[:, :c], x_BxTxJxH[:, c:]
  even_pairs, odd_pairs = zigzag_pairs(n)
  i_is_even = lax.axis_index(axis) % 2 == 0
  even = _permute(jnp.where(i_is_even, early, late), axis, [(d, s) for s, d in even_pairs])
  odd = _permute(jnp.where(i_is_even, late, early), axis, [(d, s) for s, d in odd_pairs])
  return jnp.concatenate([even, odd], axis=1)


def prefix_chunks(length: int, split: int, zigzag_over: int = 0, shards: int = 1) -> int:
  """Into how many chunks `count_before` cuts the `length` it sees, one of
  `shards` of the sequence (manual), split `split` ways by the rules: as many
  as the splits and the zigzag's chunks (over `zigzag_over` devices) need."""
  aligned = 2 * zigzag_over // shards if zigzag_over else 1
  chunks = math.lcm(aligned, split)
  return chunks if length % chunks == 0 else aligned


def count_before(x_BxLxE: jax.Array, *, zigzag: bool = False,
                 axis: str = "sequence") -> tuple[jax.Array, int]:
  """For each token, the sum of `x` over the tokens at earlier positions of
  its sequence (an exclusive prefix sum in position order), and the
  sequence's whole length, however the mesh in context splits and orders the
  length it sees: this device's shard of it where `axis` is manual (inside
  the pipeline's shard_map), the ring's zigzag order over `axis` where
  `zigzag` (as `ring_order` lays the batch), split over the mesh axes the
  active rules give `RES_LENGTH`. Without a mesh, a plain prefix sum.

  The length is cut into chunks that no shard and no zigzag chunk straddles:
  each chunk sums its own tokens and adds the [B, E] totals of the chunks at
  earlier positions, so only the chunks' totals cross devices (an all-gather
  over `axis` where it is manual, else over the rules' axes)."""
  b, length, e = x_BxLxE.shape
  mesh = jax.sharding.get_abstract_mesh()
  n = 1 if mesh.empty else mesh.shape.get(axis, 1)
  zigzag_over = n if zigzag and n > 1 else 0
  manual = axis if n > 1 and axis in mesh.manual_axes else None
  shards = n if manual else 1
  chunks = prefix_chunks(length, r.shards(r.RES_LENGTH, length), zigzag_over, shards)
  x_BxCxTxE = x_BxLxE.reshape(b, chunks, length // chunks, e)
  totals_BxCxE = x_BxCxTxE.sum(axis=2)
  totals_BxGxE = (lax.all_gather(totals_BxCxE, manual, axis=1, tiled=True) if manual
                  else r.constrain(totals_BxCxE, (r.BATCH, None, None)))
  # Each chunk's place in position order, the chunks of the whole length in the order they lie.
  g = totals_BxGxE.shape[1]
  place_G = np.arange(g)
  if zigzag_over:
    per_zigzag_chunk = g // (2 * zigzag_over)
    zigzag_G = zigzag_order(2 * zigzag_over, zigzag_over)
    place_G = zigzag_G[place_G // per_zigzag_chunk] * per_zigzag_chunk + place_G % per_zigzag_chunk
  earlier_GxG = jnp.asarray(place_G[:, None] < place_G[None, :], x_BxLxE.dtype)
  earlier_BxGxE = jnp.einsum("bge,gh->bhe", totals_BxGxE, earlier_GxG)
  if manual:
    earlier_BxGxE = lax.dynamic_slice_in_dim(earlier_BxGxE, lax.axis_index(manual) * chunks,
                                             chunks, axis=1)
  before_BxCxTxE = (jnp.cumsum(x_BxCxTxE, axis=2) - x_BxCxTxE) + earlier_BxGxE[:, :, None]
  return before_BxCxTxE.reshape(b, length, e), length * shards
