"""The routed experts' computation: tokens to the experts they chose, a grouped
GEMM per expert, the weighted outputs back.

The grouped GEMM (`experts.grouped_gemm`):
  tiled        each expert's rows padded to whole tiles, one batched GEMM over
               the tiles with each tile's expert matrices gathered beside it,
               the weight gradient per tile summed by expert. Plain dots, so
               every backend runs them as GEMMs.
  ragged_dot   `jax.lax.ragged_dot`, a grouped GEMM where the backend has one;
               XLA's GPU and CPU compilers (jax 0.10-0.11) rewrite it into a
               dense dot of every expert over every row, E times the FLOPs:
               17x the time of a dense SwiGLU of the same FLOPs on an H100,
               where `tiled` takes 2.6x (docs/moe.md).
  hopper       jax's Mosaic GPU grouped-GEMM kernels on Hopper GPUs
               (`hopper_gemm`): each row only against its own expert, no
               matrix copied; bfloat16 or float16 only. 1.4x faster than
               `tiled` on an H200, 0.60x the rate of a dense SwiGLU.
  auto         (the default) `hopper` where it runs, else `tiled`.

  grouped_experts   on one device's tokens and experts (the one-device path,
                    and each device's share inside `expert_parallel`).
  expert_parallel   experts split over mesh axes (`config.expert_parallel`):
                    each device buckets its tokens' assignments by the device
                    holding the expert, an all-to-all sends the buckets there
                    and the outputs back (two per MoE layer forward, beside
                    one of [n, E_local] counts), and every device runs its
                    own experts on what arrived.

The all-to-all (`experts.dispatch`):
  padded       `lax.all_to_all` of whole buckets, each of the fixed size below;
               every backend runs it.
  ragged       `lax.ragged_all_to_all` of the rows alone: the same buckets at
               the receiver, but only the assignments cross the network (on
               balanced routing (n - 1) / n of a device's T x K rows, where a
               padded dropless bucket sends n x min(K, E_local) / K times
               that). GPUs and TPUs only: XLA:CPU cannot compile it, so on a
               CPU it is checked against an emulation of its documented
               semantics (tests/test_moe_ragged.py); not yet run on GPUs (a
               lent machine has one, the collective needs two or more).

Rows reach the grouped GEMM (sorted by expert, in tiles, in the buckets
of the all-to-all) and come back by gathers whose gradients are gathers too
(`take_rows`): no activation is scattered, forward or backward.

Contract of both: `(x_BxLxD, expert_BxLxK, weight_BxLxK, w_gate_ExDxF,
w_up_ExDxF, w_down_ExFxD) -> y_BxLxD` with y[b, l] = sum_k weight[b, l, k] x
SwiGLU_{expert[b, l, k]}(x[b, l]); an assignment with expert -1 (dropped by
capacity) contributes nothing. Equal to a plain loop over experts.

Buckets have a fixed size: dropless, a device can send another at most
T x min(k, E_local) assignments of its T tokens, and a bucket holds that
many; with a capacity of c assignments per sequence and expert, at most
B x E_local x c. `expert_capacity` says which.

Inside `expert_parallel`'s shard_map the token axes (those splitting batch or
length), the expert axes and `tensor` are manual. `tensor` splits each
expert's hidden width (expert tensor parallelism) and the tokens of the
dispatch (Megatron-Core's MoE under sequence parallelism): each tensor device
sends its share of the tokens (`tensor_split`: of the length dropless, of the
batch with a capacity), the rows that reach a device are all-gathered over
`tensor` for its slices of the experts, and the partial outputs are
reduce-scattered back, so the all-to-all carries 1/tensor of the tokens.
Under Megatron-SP the tokens arrive split by the length, and a share of the
batch is taken from there by an all-to-all over `tensor` (`_resplit`). Where
no split has fewer rows (a short generation step), every tensor device routes
the same tokens and the partial outputs are summed over `tensor`.

Inside another shard_map (the pipeline's) it opens one over the axes still
automatic there, whose backward is a second shard_map (`_nested_shard_map`);
expert axes the caller holds manual exchange on the local shards directly.

`manual_token_sum` is the model's `token_sum` slot inside such a shard_map:
a per-token count summed over the tokens of every device that splits them.
"""

import math
from collections.abc import Callable

import flax.core.spmd
import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from meshtrain import rules as r
from meshtrain.jax_internals import varying_axes
from meshtrain.mesh import AXES
from meshtrain.parallel import hopper_gemm

TOKEN_AXES = ("data", "fsdp", "sequence")  # mesh axes that may split the tokens
EXPERT_AXES = TOKEN_AXES  # the axes `config.expert_parallel` may name
# Those of them the pipeline's shard_map holds manual, each stage's layers
# whole over them: inside a pipeline the experts split over the others.
PIPELINE_HELD_AXES = ("data", "sequence")


GEMMS = ("tiled", "ragged_dot", "hopper")  # how a device runs its experts
CHOICES = ("auto", *GEMMS)  # `experts.grouped_gemm`
DISPATCHES = ("padded", "ragged")  # `experts.dispatch`: how the all-to-alls send the rows
MAX_TILE = 1024  # the most rows of a tile of the tiled grouped GEMM


def gemm_for(choice: str, compute_dtype: str, widths: dict[str, int], device: jax.Device) -> str:
  """`experts.grouped_gemm` resolved: `auto` is `hopper` where its kernels run
  (a Hopper GPU, bfloat16 or float16, `widths` they tile), else `tiled`."""
  if choice != "auto":
    return choice
  return "tiled" if hopper_gemm.unsupported(device, compute_dtype, widths) else "hopper"


def ragged_unsupported(device: jax.Device) -> str:
  """Why `lax.ragged_all_to_all` cannot run on `device` ("" where it can)."""
  if device.platform == "cpu":
    return "XLA:CPU cannot compile lax.ragged_all_to_all (UNIMPLEMENTED in jax 0.10)"
  return ""


def _swiglu(x, dot: Callable, w_gate, w_up, w_down) -> jax.Array:
  """SwiGLU with the matmul `dot(x, w)` (float32 out), its hidden state in x's dtype."""
  h = (jax.nn.silu(dot(x, w_gate)) * dot(x, w_up)).astype(x.dtype)
  return dot(h, w_down)


def _ragged_swiglu(x_NxD: jax.Array, groups_G: jax.Array, w_gate_GxDxF: jax.Array,
                   w_up_GxDxF: jax.Array, w_down_GxFxD: jax.Array, gemm: str) -> jax.Array:
  """Rows of x grouped by expert (`groups_G` rows each, then rows of none) through
  their experts by `gemm` (`ragged_dot` or `hopper`); rows past the groups come
  out zero."""
  def dot(x, w):
    if gemm == "hopper":
      return hopper_gemm.ragged_matmul(*_varying_alike(x, w), groups_G)
    return lax.ragged_dot(x, w.astype(x.dtype), groups_G, preferred_element_type=jnp.float32)
  return _swiglu(x_NxD, dot, w_gate_GxDxF, w_up_GxDxF, w_down_GxFxD)


def _dense_dot(x: jax.Array, w: jax.Array) -> jax.Array:
  return jnp.dot(x, w.astype(x.dtype), preferred_element_type=jnp.float32)


@jax.custom_vjp
def _tile_matmul(x_TxMxK: jax.Array, w_GxKxF: jax.Array, group_T: jax.Array) -> jax.Array:
  """Tile t's rows times its group's matrix, in float32: a batched GEMM over
  tiles of one expert each, whose backward gathers the matrices again rather
  than keeping them (the weight gradient is per tile, then summed by group)."""
  return jnp.einsum("tmk,tkf->tmf", x_TxMxK, w_GxKxF[group_T].astype(x_TxMxK.dtype),
                    preferred_element_type=jnp.float32)


def _tile_matmul_fwd(x_TxMxK, w_GxKxF, group_T):
  return _tile_matmul(x_TxMxK, w_GxKxF, group_T), (x_TxMxK, w_GxKxF, group_T)


def _tile_matmul_bwd(residuals, dy_TxMxF):
  x_TxMxK, w_GxKxF, group_T = residuals
  dy_TxMxF = dy_TxMxF.astype(x_TxMxK.dtype)  # both backward GEMMs in the activations' dtype
  dx_TxMxK = jnp.einsum("tmf,tkf->tmk", dy_TxMxF, w_GxKxF[group_T].astype(x_TxMxK.dtype),
                        preferred_element_type=jnp.float32).astype(x_TxMxK.dtype)
  dw_TxKxF = jnp.einsum("tmk,tmf->tkf", x_TxMxK, dy_TxMxF, preferred_element_type=jnp.float32)
  dw_GxKxF = jax.ops.segment_sum(dw_TxKxF, group_T, num_segments=w_GxKxF.shape[0],
                                 indices_are_sorted=True)
  return dx_TxMxK, dw_GxKxF.astype(w_GxKxF.dtype), None


_tile_matmul.defvjp(_tile_matmul_fwd, _tile_matmul_bwd)


def _varying_alike(*operands: jax.Array) -> tuple[jax.Array, ...]:
  """The operands of a custom-gradient product typed as varying over every
  manual mesh axis any of them varies over, so that its backward's cotangents
  have the types of its inputs (jax sums each over the axes its input was cast
  along)."""
  axes = {a for operand in operands for a in varying_axes(operand)}
  def cast(a):
    missing = tuple(sorted(axes - set(varying_axes(a))))
    return lax.pcast(a, missing, to="varying") if missing else a
  return tuple(map(cast, operands))


@jax.custom_vjp
def _take_rows(x_NxD: jax.Array, source_M: jax.Array, sinks_NxK: jax.Array) -> jax.Array:
  """Row m of the result is x[source_M[m]] (zero where source_M[m] is out of
  range). `sinks_NxK` names, for each row n of x, the rows of the result that
  took it (out of range: none), so that the gradient is a gather as well,
  dx[n] = sum_k dy[sinks[n, k]], where jax would scatter-add. Each row is
  taken at most K times, so it is the caller's contract that source[sinks[n,
  k]] == n for every sink in range and that every m with source_M[m] in range
  is among its sinks."""
  return x_NxD.at[source_M].get(mode="fill", fill_value=0)


def _take_rows_fwd(x_NxD, source_M, sinks_NxK):
  return _take_rows(x_NxD, source_M, sinks_NxK), sinks_NxK


def _take_rows_bwd(sinks_NxK, dy_MxD):
  dx_NxKxD = dy_MxD.at[sinks_NxK].get(mode="fill", fill_value=0)
  return dx_NxKxD.sum(axis=1, dtype=jnp.float32).astype(dy_MxD.dtype), None, None


_take_rows.defvjp(_take_rows_fwd, _take_rows_bwd)


def take_rows(x_NxD: jax.Array, source_M: jax.Array, sinks_NxK: jax.Array) -> jax.Array:
  """`_take_rows` with its operands typed alike over the manual mesh axes."""
  return _take_rows(*_varying_alike(x_NxD, source_M, sinks_NxK))


def _sources(sink_A: jax.Array, size: int) -> jax.Array:
  """The inverse of an injective `sink_A` (entries past `size`: none): for each
  of `size` rows, the a whose sink it is, else len(sink_A)."""
  count = sink_A.shape[0]
  return jnp.full((size,), count, sink_A.dtype).at[sink_A].set(
      jnp.arange(count, dtype=sink_A.dtype), mode="drop")


def _assignment_rows(x_TxD: jax.Array, place_A: jax.Array, source_M: jax.Array) -> jax.Array:
  """Row m: the token of assignment `source_M[m]` (none: zero), for a token's
  k assignments (a = t * k + j) placed at `place_A`, the inverse of `source_M`."""
  t, a = x_TxD.shape[0], place_A.shape[0]
  return take_rows(x_TxD, jnp.where(source_M < a, source_M // (a // t), t),
                   place_A.reshape(t, a // t))


def tile_rows(rows: int, groups: int) -> int:
  """Rows of a tile: the power of two at or below a quarter of a group's mean
  share, at most `MAX_TILE`. Padding costs at most one tile a group (a quarter
  of the rows), and a bigger tile gathers fewer copies of the weights: on an
  H100, 1,024-row tiles ran 8 experts' SwiGLU at 2.6x the time of a dense one
  of the same FLOPs, 512-row ones at 3.0x (docs/moe.md)."""
  share = max(1, rows // (4 * max(groups, 1)))
  return min(MAX_TILE, 1 << (share.bit_length() - 1))


def _place_in_run(order_key_N: jax.Array, run_N: jax.Array, start_R: jax.Array) -> jax.Array:
  """Each row's place in its run when the rows are sorted by `order_key_N`
  (stably), run r's rows starting at `start_R[r]` of that order (runs past
  `start_R`: from 0)."""
  order_N = jnp.argsort(order_key_N, stable=True)
  sorted_N = jnp.arange(order_key_N.shape[0]) - start_R.at[run_N[order_N]].get(
      mode="fill", fill_value=0)
  return jnp.zeros_like(run_N).at[order_N].set(sorted_N)


def _tile_layout(key_A: jax.Array, groups_G: jax.Array) -> tuple[jax.Array, jax.Array, int]:
  """The tiled grouped GEMM's rows: (slot_A, group_T, M). Each expert's rows
  (`key_A`, G: none) are padded to whole tiles of M rows; slot_A is each row's
  place in the tiles (rows of none: past the end) and group_T each tile's
  expert. Tiles: sum_g ceil(rows_g / M) < A / M + G, so at most ceil(A / M) +
  G - 1, a static bound."""
  a, g = key_A.shape[0], groups_G.shape[0]
  m = tile_rows(a, g)
  tiles = -(-a // m) + g - 1
  padded_G = -(-groups_G // m) * m
  padded_start_G = jnp.cumsum(padded_G) - padded_G
  rank_A = _place_in_run(key_A, key_A, jnp.cumsum(groups_G) - groups_G)
  slot_A = jnp.where(key_A < g, padded_start_G.at[key_A].get(mode="fill", fill_value=0) + rank_A,
                     tiles * m)
  # A tile belongs to the group whose padded run holds its first row (tiles past all: the last).
  group_T = jnp.minimum(jnp.sum(jnp.arange(tiles)[:, None] * m >= jnp.cumsum(padded_G)[None, :],
                                axis=1), g - 1)
  return slot_A, group_T, m


def _grouped(x_NxD: jax.Array, expert_NxK: jax.Array, num_experts: int, w_gate, w_up, w_down,
             gemm: str = "tiled") -> jax.Array:
  """out[n, k]: row n through its expert `expert_NxK[n, k]` (-1: none, zero
  out), in x's dtype, by `gemm` (one of `GEMMS`); one expert (each device's own
  under expert parallelism as wide as the experts) by a plain SwiGLU on every
  row. The rows reach the GEMM's buffer and come back by gathers alone
  (`take_rows`), forward and backward: a D-wide scatter would add atomically
  on a GPU."""
  n, k = expert_NxK.shape
  d = x_NxD.shape[-1]
  if num_experts == 1:
    y_NxD = _swiglu(x_NxD, _dense_dot, w_gate[0], w_up[0], w_down[0]).astype(x_NxD.dtype)
    return jnp.where((expert_NxK == 0)[..., None], y_NxD[:, None], jnp.zeros((), x_NxD.dtype))
  key_A = jnp.where(expert_NxK >= 0, expert_NxK, num_experts).reshape(n * k)
  groups_G = jnp.bincount(key_A, length=num_experts + 1)[:num_experts].astype(jnp.int32)
  if gemm == "tiled":
    slot_A, group_T, m = _tile_layout(key_A, groups_G)
    source_S = _sources(slot_A, group_T.shape[0] * m)
    dot = lambda x, w: _tile_matmul(*_varying_alike(x, w), group_T)  # noqa: E731
    swiglu = lambda x_SxD: _swiglu(  # noqa: E731
        x_SxD.reshape(-1, m, d), dot, w_gate, w_up, w_down).reshape(-1, d)
  else:  # sorted by expert, rows of none last
    source_S = jnp.argsort(key_A, stable=True)
    slot_A = _sources(source_S, n * k)
    swiglu = lambda x_SxD: _ragged_swiglu(  # noqa: E731
        x_SxD, groups_G, w_gate, w_up, w_down, gemm)
  y_SxD = swiglu(_assignment_rows(x_NxD, slot_A, source_S))
  y_SxD = y_SxD.astype(x_NxD.dtype)  # back in the activations' dtype
  return take_rows(y_SxD, slot_A, source_S[:, None]).reshape(n, k, d)


def grouped_experts(x_BxLxD, expert_BxLxK, weight_BxLxK, w_gate_ExDxF, w_up_ExDxF,
                    w_down_ExFxD, *, gemm: str = "tiled") -> jax.Array:
  """All experts on this device: every assignment a row, grouped by expert."""
  b, length, d = x_BxLxD.shape
  k = expert_BxLxK.shape[-1]
  out_TxKxD = _grouped(x_BxLxD.reshape(b * length, d), expert_BxLxK.reshape(b * length, k),
                       w_gate_ExDxF.shape[0], w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD, gemm)
  y_TxD = jnp.einsum("tkd,tk->td", out_TxKxD, weight_BxLxK.reshape(b * length, k).astype(
      jnp.float32))
  return y_TxD.reshape(b, length, d).astype(x_BxLxD.dtype)


def manual_token_sum(x_BxL: jax.Array, axes: tuple[str, ...]) -> jax.Array:
  """Sum over the leading [batch, length] dimensions and over those of the
  mesh `axes` that split them manually here (none outside a shard_map)."""
  mesh = jax.sharding.get_abstract_mesh()
  manual = tuple(a for a in axes if not mesh.empty and a in mesh.manual_axes)
  return lax.psum(x_BxL.sum(axis=(0, 1)), manual) if manual else x_BxL.sum(axis=(0, 1))


def expert_capacity(tokens: int, rows: int, k: int, local_experts: int,
                    per_sequence: int = 0) -> int:
  """A bucket's size: what one device can send another (module docstring)."""
  dropless = tokens * min(k, local_experts)
  return min(dropless, rows * local_experts * per_sequence) if per_sequence else dropless


def _exchange(x_TxD, expert_TxK, weight_TxK, w_gate, w_up, w_down, *, axes: tuple[str, ...],
              n: int, capacity: int, tensor: str | None, tensor_splits_tokens: bool, gemm: str,
              dispatch: str):
  """One device's share: its T tokens' assignments to the n devices of `axes`
  (expert e on device e // E_local), its E_local experts on what arrives.

  Each device's rows reach another ordered by expert, so the receiver learns
  what it got from the counts per expert alone (a small all-to-all of
  [n, E_local] integers), not from an id per row. It holds them in n slots of
  `capacity` rows, one per source. `dispatch` "padded" sends whole slots
  (`lax.all_to_all`); "ragged" sends the rows alone (`lax.ragged_all_to_all`)
  from a buffer of the T x K assignments sorted by device, the senders' offsets
  in it going along with the counts for the way back. Where
  `tensor_splits_tokens`, the tensor devices' rows are gathered for their
  slices of the experts and the partial outputs reduce-scattered back; else
  every tensor device holds the same rows and the partial outputs are summed."""
  t, k = expert_TxK.shape
  d, local = x_TxD.shape[-1], w_gate.shape[0]
  num_experts = n * local
  ragged = dispatch == "ragged" and n > 1
  expert_A = expert_TxK.reshape(t * k)
  expert_A = jnp.where(expert_A >= 0, expert_A, num_experts)  # num_experts: dropped
  counts_E = jnp.bincount(expert_A, length=num_experts + 1)[:num_experts].astype(jnp.int32)
  counts_NxL = counts_E.reshape(n, local)
  sent_N = counts_NxL.sum(1)
  dest_A = expert_A // local  # n: dropped, sent nowhere
  starts_N = jnp.cumsum(sent_N) - sent_N
  slot_A = _place_in_run(expert_A, dest_A, starts_N)  # by device, then by its experts
  # Each assignment's row in the send buffer (dropped or past its slot: none):
  # the n slots of `capacity` rows, or (ragged) the runs by device.
  if ragged:
    place_A = jnp.where(dest_A < n, starts_N.at[dest_A].get(mode="fill", fill_value=0) + slot_A,
                        t * k)
  else:
    place_A = jnp.where((dest_A < n) & (slot_A < capacity), dest_A * capacity + slot_A,
                        n * capacity)
  source_M = _sources(place_A, t * k if ragged else n * capacity)
  send_MxD = _assignment_rows(x_TxD, place_A, source_M)
  if ragged:  # the senders' starts travel with the counts, for the way back
    counts_NxL1 = lax.all_to_all(jnp.concatenate([counts_NxL, starts_N[:, None]], axis=1), axes,
                                 0, 0, tiled=True)
    counts_NxL, their_starts_N = counts_NxL1[:, :-1], counts_NxL1[:, -1]
    received_N = counts_NxL.sum(1)
    slots_N = jnp.arange(n, dtype=jnp.int32) * capacity  # source i's slot here
    mine_N = jnp.full((n,), lax.axis_index(axes) * capacity, jnp.int32)  # my slot there
    rows_MxD = _ragged_all_to_all(send_MxD, n * capacity, starts_N, sent_N, mine_N, received_N,
                                  axes)
  elif n > 1:
    rows_MxD = lax.all_to_all(send_MxD.reshape(n, capacity, d), axes, 0, 0,
                              tiled=True).reshape(n * capacity, d)
    counts_NxL = lax.all_to_all(counts_NxL, axes, 0, 0, tiled=True)
  else:
    rows_MxD = send_MxD
  # Row c from source j belongs to the expert whose run of j's rows holds c.
  ends_NxL = jnp.cumsum(counts_NxL, axis=1)
  expert_NxC = jnp.sum(jnp.arange(capacity)[None, :, None] >= ends_NxL[:, None, :], axis=-1)
  expert_M = jnp.where(expert_NxC < local, expert_NxC, -1).reshape(n * capacity, 1)
  if tensor_splits_tokens:  # every tensor device's rows through this one's slices
    rows_MxD = lax.all_gather(rows_MxD, tensor, tiled=True)
    expert_M = lax.all_gather(expert_M, tensor, tiled=True)
  out_MxD = _grouped(rows_MxD, expert_M, local, w_gate, w_up, w_down, gemm)[:, 0]
  if tensor_splits_tokens:
    out_MxD = lax.psum_scatter(out_MxD, tensor, scatter_dimension=0, tiled=True)
  elif tensor:  # each tensor device ran its slice of the hidden width
    out_MxD = lax.psum(out_MxD, tensor)
  if ragged:
    back_MxD = _ragged_all_to_all(out_MxD, t * k, slots_N, received_N, their_starts_N, sent_N,
                                  axes)
  elif n > 1:
    back_MxD = lax.all_to_all(out_MxD.reshape(n, capacity, d), axes, 0, 0,
                              tiled=True).reshape(n * capacity, d)
  else:
    back_MxD = out_MxD
  out_AxD = take_rows(back_MxD, place_A, source_M[:, None])
  y_TxD = jnp.einsum("tkd,tk->td", out_AxD.reshape(t, k, d), weight_TxK.astype(jnp.float32))
  return y_TxD.astype(x_TxD.dtype)


def _ragged_all_to_all(rows_RxD: jax.Array, size: int, offsets_N: jax.Array, sizes_N: jax.Array,
                       their_offsets_N: jax.Array, received_N: jax.Array,
                       axes: tuple[str, ...]) -> jax.Array:
  """`sizes_N[j]` rows from `offsets_N[j]` of `rows_RxD` to device j of `axes`,
  placed there at `their_offsets_N[j]` of a buffer of `size` rows (zero
  where nothing arrives), `received_N[i]` arriving from device i.

  Under a vmap (local SGD's replicas) jax 0.10.2's batching rule of the
  collective asserts that every offset and size is batched, so each is made
  to depend on `sizes_N`, which the routing gives."""
  output_SxD = _varying_alike(jnp.zeros((size, rows_RxD.shape[1]), rows_RxD.dtype), rows_RxD)[0]
  zero_N = sizes_N * 0
  return lax.ragged_all_to_all(rows_RxD, output_SxD, offsets_N + zero_N, sizes_N,
                               their_offsets_N + zero_N, received_N + zero_N, axis_name=axes)


def _token_axes(mesh, batch_size: int, length: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
  """The mesh axes (not yet manual) that split the batch and the length, by
  the active logical rules."""
  rules = dict(flax.core.spmd.get_logical_axis_rules() or ())
  free = lambda axes: tuple(a for a in axes if mesh.shape.get(a, 1) > 1  # noqa: E731
                            and a not in mesh.manual_axes and a in TOKEN_AXES)
  batch, length_axes = free(rules.get(r.BATCH, ())), free(rules.get(r.LENGTH, ()))
  if batch_size % math.prod(mesh.shape[a] for a in batch):
    batch = ()
  if length % math.prod(mesh.shape[a] for a in length_axes):
    length_axes = ()
  return batch, length_axes


def share_capacity(rows: int, length: int, tensor: int, split: str, k: int, local: int,
                   per_sequence: int = 0) -> int:
  """A bucket's size when each of `tensor` devices dispatches its `split`
  share (`tensor_split`) of a device's `rows` x `length` tokens."""
  rows, length = {"length": (rows, length // tensor),
                  "batch": (rows // tensor, length)}.get(split, (rows, length))
  return expert_capacity(rows * length, rows, k, local, per_sequence)


def tensor_split(rows: int, length: int, tensor: int, k: int, local: int,
                 per_sequence: int = 0) -> str:
  """Which of a device's `rows` x `length` tokens each of `tensor` devices
  dispatches: "length" or "batch" (its share of that dimension), or "" (every
  token). The one whose buckets, summed over the tensor devices (the rows
  each one's experts then run), are fewest; on a tie a split (its all-to-all
  is 1/tensor), the length first (Megatron-SP's split, so its activations
  need no reshard). Dropless both splits halve the buckets; with a capacity
  per sequence only the batch does, since one device's share of a sequence
  may send as many rows to an expert as the whole sequence."""
  divides = {"": True, "length": tensor > 1 and length % tensor == 0,
             "batch": tensor > 1 and rows % tensor == 0}
  rows_run = {split: (tensor if split else 1) * share_capacity(rows, length, tensor, split, k,
                                                               local, per_sequence)
              for split, ok in divides.items() if ok}
  return min(rows_run, key=lambda split: (rows_run[split], not split, split == "batch"))


def _resplit(x_BxLx_: jax.Array, tensor: str | None, source: str, target: str) -> jax.Array:
  """A device's tokens split over `tensor` by `source` ("batch" or "length"),
  split by `target` instead (an all-to-all over `tensor`)."""
  if source == target:
    return x_BxLx_
  dims = {"batch": 0, "length": 1}
  return lax.all_to_all(x_BxLx_, tensor, dims[target], dims[source], tiled=True)


def expert_parallel(x_BxLxD, expert_BxLxK, weight_BxLxK, w_gate_ExDxF, w_up_ExDxF,
                    w_down_ExFxD, *, axes: tuple[str, ...], per_sequence: int = 0,
                    gemm: str = "tiled", dispatch: str = "padded") -> jax.Array:
  """The experts split over the mesh axes `axes` (the module docstring); with
  the mesh in context. `per_sequence` is the capacity of an expert per sequence
  (0: dropless); `dispatch` one of `DISPATCHES`."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return grouped_experts(x_BxLxD, expert_BxLxK, weight_BxLxK, w_gate_ExDxF, w_up_ExDxF,
                           w_down_ExFxD, gemm=gemm)
  b, length, d = x_BxLxD.shape
  batch, length_axes = _token_axes(mesh, b, length)
  tensor = "tensor" if mesh.shape.get("tensor", 1) > 1 and "tensor" not in mesh.manual_axes \
      else None
  axes = tuple(sorted((a for a in axes if mesh.shape.get(a, 1) > 1), key=AXES.index))
  n = math.prod(mesh.shape[a] for a in axes)
  local, k = w_gate_ExDxF.shape[0] // n, expert_BxLxK.shape[-1]
  rows = b // math.prod(mesh.shape[a] for a in batch)
  length_here = length // math.prod(mesh.shape[a] for a in length_axes)
  t = mesh.shape[tensor] if tensor else 1
  split = tensor_split(rows, length_here, t, k, local, per_sequence)
  # The tokens come split over `tensor` by the length under Megatron-SP, else
  # whole: a split of the batch then takes them by an all-to-all over `tensor`.
  rules = dict(flax.core.spmd.get_logical_axis_rules() or ())
  arrival = ("length" if split and tensor in rules.get(r.RES_LENGTH, ())
             and length_here % t == 0 else split)
  capacity = share_capacity(rows, length_here, t, split, k, local, per_sequence)
  with_tensor = lambda axes, dim: tuple(  # noqa: E731
      sorted((*axes, tensor), key=AXES.index)) if arrival == dim else axes
  batch, length_axes = with_tensor(batch, "batch"), with_tensor(length_axes, "length")
  # Every token axis is manual, also one the rules leave out of the batch: a
  # vmap over it (local SGD's replicas) puts it on a dimension of its own.
  token_axes = (a for a in TOKEN_AXES if mesh.shape.get(a, 1) > 1)
  manual = {*token_axes, *axes, *([tensor] if tensor else [])} - set(mesh.manual_axes)

  def device(x_BxLxD, expert_BxLxK, weight_BxLxK, w_gate, w_up, w_down):
    x_BxLxD, expert_BxLxK, weight_BxLxK = (_resplit(a, tensor, arrival, split)
                                           for a in (x_BxLxD, expert_BxLxK, weight_BxLxK))
    rows, length_here = x_BxLxD.shape[:2]
    y_TxD = _exchange(x_BxLxD.reshape(rows * length_here, d),
                      expert_BxLxK.reshape(rows * length_here, -1),
                      weight_BxLxK.reshape(rows * length_here, -1), w_gate, w_up, w_down,
                      axes=axes, n=n, capacity=capacity, tensor=tensor,
                      tensor_splits_tokens=bool(split), gemm=gemm, dispatch=dispatch)
    return _resplit(y_TxD.reshape(rows, length_here, d), tensor, split, arrival)

  if not manual:  # every axis is already manual (inside the pipeline): local shards
    return device(x_BxLxD, expert_BxLxK, weight_BxLxK, w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD)
  tokens_spec = P(batch or None, length_axes or None)
  experts = axes or None
  # A batch too small to split over an expert axis (generation): every device
  # of that axis routes the same tokens and gets the same outputs back, which
  # the type system cannot see. Training batches always split.
  replicated = any(a not in (*batch, *length_axes) for a in axes)
  in_specs = (tokens_spec, tokens_spec, tokens_spec, P(experts, None, tensor),
              P(experts, None, tensor), P(experts, tensor, None))
  operands = (x_BxLxD, expert_BxLxK, weight_BxLxK, w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD)
  if mesh.manual_axes:  # inside another shard_map (the pipeline's)
    return _nested_shard_map(device, mesh, manual, in_specs, tokens_spec, *operands)
  return jax.shard_map(device, mesh=mesh, axis_names=manual, in_specs=in_specs,
                       out_specs=tokens_spec, check_vma=not replicated)(*operands)


def _nested_shard_map(device: Callable, mesh, manual: set[str], in_specs: tuple,
                      out_spec: P, x, expert, *weights) -> jax.Array:
  """`jax.shard_map(device)` over the `manual` axes inside another shard_map,
  differentiable in `x` and `weights` (not the integer `expert`): its forward
  and backward are two shard_maps, the vjp's residuals handed from one to the
  other on a leading axis split over the `manual` axes each varies over, so
  that they keep their types. (jax 0.10 gives the residuals of its own
  transpose of a nested shard_map specs that also name the outer one's manual
  axes, which Shardy's verifier refuses.)"""
  float_specs = (in_specs[0], *in_specs[2:])
  structure = {}

  def forward_device(x, expert, *weights):
    y, vjp = jax.vjp(lambda x, *weights: device(x, expert, *weights), x, *weights)
    residuals, structure["vjp"] = jax.tree.flatten(vjp)
    structure["specs"] = [P(tuple(a for a in AXES if a in manual and a in varying_axes(r))
                            or None) for r in residuals]
    return y, [r[None] for r in residuals]

  def forward(x, expert, *weights):
    jax.eval_shape(jax.shard_map(lambda *args: forward_device(*args)[0], mesh=mesh,
                                 axis_names=manual, in_specs=in_specs, out_specs=out_spec),
                   x, expert, *weights)  # the residuals' specs
    return jax.shard_map(forward_device, mesh=mesh, axis_names=manual, in_specs=in_specs,
                         out_specs=(out_spec, structure["specs"]))(x, expert, *weights)

  def backward_device(residuals, dy):
    return jax.tree.unflatten(structure["vjp"], [r[0] for r in residuals])(dy)

  def backward(residuals, dy):
    dx, *dweights = jax.shard_map(backward_device, mesh=mesh, axis_names=manual,
                                  in_specs=(structure["specs"], out_spec),
                                  out_specs=float_specs)(residuals, dy)
    return dx, None, *dweights

  run = jax.custom_vjp(jax.shard_map(device, mesh=mesh, axis_names=manual, in_specs=in_specs,
                                     out_specs=out_spec))
  run.defvjp(forward, backward)
  return run(x, expert, *weights)
