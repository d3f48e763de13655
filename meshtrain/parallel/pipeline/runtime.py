"""One `shard_map` executor that runs any valid schedule table (`schedule.py`).

`pipeline_loss_and_grads` returns what `jax.value_and_grad` of the unpipelined
model gives for the mean loss over M microbatches, but runs the model as a
pipeline: manual over the `pipeline` mesh axis (and optionally the pure batch
axes), so the other axes (batch over fsdp, weights over fsdp/tensor) stay
automatic and GSPMD partitions the per-stage work as it would outside.

Inside, one `lax.scan` over the schedule's ticks. Each tick a stage
  1. writes the activation and gradient that arrived (sent last tick) into
     the slots `act_recv_slot` and `grad_recv_slot` name;
  2. runs one op, `lax.switch` on idle / F / B / W (first- and last-chunk
     variants: the embedding, the head and loss), read from its row;
  3. sends its F output right and its input gradient left on the ring, every
     tick and outside the switch (idle stages send zeros), so every stage
     runs the same collectives.
Each layer's backward is split into B and W (`split.split_vjp`): F keeps the
layer's vjp residuals (as the layer's `jax.checkpoint` policy decides) in the
`res` stash, B computes the input gradient and leaves what W needs in the
`cut` stash, W adds the weight gradients into the scan carry and frees both.
Nothing runs twice: the step does the FLOPs of the unpipelined step.
Buffers are read before and written after the switch, so XLA updates them in
place (passed through a conditional, they were copied once more).

Model contract (any model, not only Llama):
  embed_fn(embed_params, inputs_BxL) -> x_BxLxD
  layer_fn(layer_params, x_BxLxD, aux) -> x_BxLxD: one layer; a chunk is Lc
    layers stacked on a leading axis, scanned by the executor
  loss_fn(head_params, x_BxLxD, aux) -> scalar mean loss
`aux` is the microbatch's other [B, L] arrays (targets, positions, segment
ids). Stage 0 runs `embed_fn` before chunk 0; the last stage runs `loss_fn`
after the last chunk and seeds the backward with d(loss / M).

An XLA SPMD partitioner abort to steer around (jax 0.10.2, Shardy and GSPMD
alike; a plain `jax.jit` of the same op compiles): a gather inside this
partially manual `shard_map` whose operand and indices are sharded over the
same automatic axis, with a third mesh axis larger than one, fails with
"Check failed: partition_group_list.num_replica_groups() * ...
num_devices_per_group() == device_groups.num_devices_per_group()". Two
model pieces hit it: an embedding lookup whose table splits D over `fsdp`
(with tensor > 1), and optax's integer-label cross-entropy with vocab over
`tensor` and batch over `data` or `fsdp`. Gathering the table's D before the
lookup and a one-hot cross-entropy avoid it.
"""

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, PartitionSpec

from meshtrain.jax_internals import varying_axes
from meshtrain.parallel.pipeline import schedule as schedules
from meshtrain.parallel.pipeline.schedule import Schedule
from meshtrain.parallel.pipeline.split import split_vjp

AXIS = "pipeline"
# The switch's branches, one per (op, first/last chunk) the executor tells apart.
BRANCHES = ("idle", "F", "F first", "F last", "B", "B first", "B last", "W", "W last")


def branch_table(schedule: Schedule) -> np.ndarray:
  """[ticks, stages] index into BRANCHES."""
  stage = np.arange(schedule.num_stages)[None, :]
  first = (stage == 0) & (schedule.chunk == 0)
  last = (stage == schedule.num_stages - 1) & (schedule.chunk == schedule.num_chunks - 1)
  op = schedule.op
  return np.select(
      [op == schedules.IDLE, (op == schedules.F) & first, (op == schedules.F) & last,
       op == schedules.F, (op == schedules.B) & first, (op == schedules.B) & last,
       op == schedules.B, (op == schedules.W) & last, op == schedules.W],
      [0, 2, 3, 1, 5, 6, 4, 8, 7]).astype(np.int32)


def branch_weights(schedule: Schedule) -> list[float]:
  """Per branch, the share of ticks a device runs it, averaged over stages:
  the weights `analysis.compiled_flops.dot_flops` needs for the tick switch."""
  counts = np.bincount(branch_table(schedule).ravel(), minlength=len(BRANCHES))
  return [float(c) / schedule.op.size for c in counts]


def to_stages(layers: Any, num_stages: int, num_chunks: int) -> Any:
  """[P*V*Lc, ...] leaves -> [V, P, Lc, ...]: [v, s] is chunk c = v*P + s.

  With the P axis sharded over `pipeline`, stage s holds its V chunks. For
  V = 1 this is the layout a contiguous `layers -> pipeline` sharding already
  has (the reshape moves nothing); for V > 1 stage s holds layers that are not
  contiguous, so a contiguous sharding of [P*V*Lc] would be permuted on every
  call: store the weights stage-major to avoid that.
  """
  def split(x):
    if x.shape[0] % (num_stages * num_chunks):
      raise ValueError(f"{x.shape[0]} layers do not split into {num_chunks} chunks "
                       f"on each of {num_stages} stages")
    return x.reshape(num_chunks, num_stages, -1, *x.shape[1:])
  return jax.tree.map(split, layers)


def from_stages(staged: Any) -> Any:
  """The inverse of `to_stages`: [V, P, Lc, ...] -> [P*V*Lc, ...]."""
  return jax.tree.map(lambda x: x.reshape(-1, *x.shape[3:]), staged)


def _varying(tree: Any, axes: tuple[str, ...]) -> Any:
  """Types values invariant over `axes` as varying, as every branch's outputs
  must be (an invariant zero and a computed value do not match)."""
  def cast(x):
    varying = varying_axes(x)
    missing = tuple(a for a in axes if a not in varying)
    return lax.pcast(x, missing, to="varying") if missing else x
  return jax.tree.map(cast, tree)


def _take(tree: Any, i: jax.Array) -> Any:
  return jax.tree.map(lambda x: lax.dynamic_index_in_dim(x, i, 0, keepdims=False), tree)


def _read(buffers: Any, slot: jax.Array) -> Any:
  return _take(buffers, jnp.maximum(slot, 0))


def _put(buffers: Any, slot: jax.Array, value: Any) -> Any:
  """Writes `value` into `slot` of each buffer; slot -1 writes nothing."""
  i = jnp.maximum(slot, 0)

  def put(buffer, x):
    kept = lax.dynamic_index_in_dim(buffer, i, 0, keepdims=False)
    return lax.dynamic_update_index_in_dim(buffer, jnp.where(slot >= 0, x, kept), i, 0)
  return jax.tree.map(put, buffers, value)


def _add_at(tree: Any, i: jax.Array, update: Any) -> Any:
  return jax.tree.map(
      lambda acc, u: lax.dynamic_update_index_in_dim(
          acc, lax.dynamic_index_in_dim(acc, i, 0, keepdims=False) + u.astype(acc.dtype), i, 0),
      tree, update)


def _add(acc: Any, update: Any) -> Any:
  return jax.tree.map(lambda a, u: a + u.astype(a.dtype), acc, update)


def _zeros(structs: Any, lead: tuple[int, ...] = (), dtype=None) -> Any:
  return jax.tree.map(lambda s: jnp.zeros(lead + tuple(s.shape), dtype or s.dtype), structs)


def _check(schedule: Schedule, mesh: Mesh, microbatches: dict[str, jax.Array]) -> None:
  if mesh.shape[AXIS] != schedule.num_stages:
    raise ValueError(f"schedule has {schedule.num_stages} stages but the mesh has "
                     f"pipeline={mesh.shape[AXIS]}")
  leading = {key: x.shape[0] for key, x in microbatches.items()}
  if set(leading.values()) != {schedule.num_microbatches}:
    raise ValueError(f"schedule has {schedule.num_microbatches} microbatches but the "
                     f"microbatch arrays lead with {leading}")


def pipeline_loss_and_grads(
    schedule: Schedule, mesh: Mesh, *,
    embed_fn: Callable[[Any, jax.Array], jax.Array],
    layer_fn: Callable[[Any, jax.Array, dict], jax.Array],
    loss_fn: Callable[[Any, jax.Array, dict], jax.Array],
    params: dict[str, Any], microbatches: dict[str, jax.Array],
    batch_axes: Sequence[str] = (),
    length_axis: str | None = None,
    replica_axis: str | None = None) -> tuple[jax.Array, dict[str, Any] | None]:
  """Mean loss over the M microbatches and its gradients, run by `schedule`.

  Args:
    schedule: a valid table with P = mesh.shape["pipeline"] stages, M
      microbatches and V chunks per stage. A forward-only table
      (`schedule.forward_only`) gives the loss and None for the gradients.
    mesh: the device mesh.
    embed_fn, layer_fn, loss_fn: the model in three pieces (module docstring).
    params: {"embed": ..., "layers": ..., "head": ...} pytrees. `layers`
      leaves stack P*V*Lc layers on a leading axis; chunk c = v*P + s (on
      stage s) is layers [c*Lc, (c+1)*Lc) (`to_stages`). `embed` and `head`
      are replicated over `pipeline`.
    microbatches: {"inputs": [M, B, L], ...}: every key but "inputs" reaches
      layer_fn and loss_fn as `aux`; replicated over `pipeline`, B may be
      sharded over the other axes.
    batch_axes: mesh axes that shard B but no weight (`data`) to take manual
      along with `pipeline`. By default they stay automatic and GSPMD reduces
      the weight gradients over them inside every W tick, once per
      microbatch; taken manual, each device adds up its own gradients and
      they are summed over these axes once, after the last tick. The model
      pieces then see their local batch and must not constrain over these
      axes; `loss_fn` must be a mean over equal local batches.
    length_axis: a mesh axis that shards L (`sequence`), taken manual the
      same way: the pieces see their local tokens (and run attention's
      collectives over it themselves), `loss_fn` is a mean over them.
    replica_axis: a mesh axis whose devices hold independent replicas (local
      SGD's `data`): every params leaf leads with a replica dimension split
      over it, B is split over it too, and the loss and gradients come back
      per replica ([R] and [R, ...]), never summed over it.

  Returns:
    (loss, grads): float32, grads shaped like params. Embed and head gradients are
    summed over `pipeline` once, after the last tick (only stage 0, resp.
    P-1, has a nonzero one): one all-reduce per step instead of a collective
    per tick, and none inside a branch that only some stages take.
  """
  _check(schedule, mesh, microbatches)
  num_stages, num_chunks = schedule.num_stages, schedule.num_chunks
  backward = schedule.has_backward
  # Axes that split the microbatch but no weight: each device sums its own gradients.
  split_axes = (*batch_axes, *([length_axis] if length_axis else []))
  replica = (replica_axis,) if replica_axis else ()
  summed = (AXIS, *split_axes)  # what the loss and the embed and head gradients add up over
  manual = (*summed, *replica)
  # Each device's loss is the mean over its equal share of a microbatch.
  scale = 1 / (schedule.num_microbatches * math.prod(mesh.shape[a] for a in split_axes))
  batch_spec = PartitionSpec(None, (*batch_axes, *replica) or None, length_axis)
  fields = ("op", "mb", "chunk", *schedules.SLOT_FIELDS)
  tables = {name: getattr(schedule, name) for name in fields}
  tables["branch"] = branch_table(schedule)

  def run(embed_p, layers_Vx1xLc, head_p, microbatches):
    if replica:  # this device's replica
      embed_p, layers_Vx1xLc, head_p = jax.tree.map(lambda x: x[0],
                                                    (embed_p, layers_Vx1xLc, head_p))
    loss, grads = run_replica(embed_p, layers_Vx1xLc, head_p, microbatches)
    return jax.tree.map(lambda x: x[None], (loss, grads)) if replica else (loss, grads)

  def run_replica(embed_p, layers_Vx1xLc, head_p, microbatches):
    stage = lax.axis_index(AXIS)
    # Every stage has every microbatch; typed varying like the activations they meet.
    microbatches = _varying(microbatches, (AXIS,))
    inputs = microbatches["inputs"]
    aux_all = {k: v for k, v in microbatches.items() if k != "inputs"}
    # The vjps differentiate weights typed varying: the transpose of the
    # implicit invariant->varying cast would be a psum in every tick.
    embed_p, head_p = _varying((embed_p, head_p), manual)
    layers_VxLc = _varying(jax.tree.map(lambda x: x[:, 0], layers_Vx1xLc), (*split_axes, *replica))
    one_layer = jax.tree.map(lambda x: x[0, 0], layers_VxLc)
    aux0 = _take(aux_all, 0)
    x_struct = jax.eval_shape(embed_fn, embed_p, inputs[0])
    zeros_x = _varying(jnp.zeros(x_struct.shape, x_struct.dtype), manual)
    if backward:
      layer = split_vjp(layer_fn, one_layer, zeros_x, aux0)
      head = split_vjp(lambda p, x, aux: loss_fn(p, x, aux) * scale, head_p, zeros_x, aux0)
    num_layers = jax.tree.leaves(layers_VxLc)[0].shape[1]

    def chunk_forward(v, x, aux):
      def body(x, p):
        return layer.forward(p, x, aux) if backward else (layer_fn(p, x, aux), [])
      return lax.scan(body, x, _take(layers_VxLc, v))

    def chunk_backward_input(v, res_Lc, aux, dy):
      def body(dy, p_res):
        return layer.backward_input(*p_res[:1], aux, p_res[1], dy)
      return lax.scan(body, dy, (_take(layers_VxLc, v), res_Lc), reverse=True)

    def chunk_backward_weight(v, res_Lc, cut_Lc, aux):
      def body(_, p_res_cut):
        p, res, cut = p_res_cut
        return None, layer.backward_weight(p, aux, res, cut)
      return lax.scan(body, None, (_take(layers_VxLc, v), res_Lc, cut_Lc))[1]

    # Every branch: (acc, op, x, dy, res, cut, head_res, head_cut) ->
    #   (acc, y, dx, res, cut, head_res, head_cut), unused outputs zero.
    def out(acc, y=None, dx=None, res=None, cut=None, head_res=None, head_cut=None):
      return (acc, zeros_x if y is None else y, zeros_x if dx is None else dx,
              zero_res if res is None else res, zero_cut if cut is None else cut,
              zero_head_res if head_res is None else head_res,
              zero_head_cut if head_cut is None else head_cut)

    def idle(acc, op, x, dy, res, cut, head_res, head_cut):
      return out(acc)

    def f(acc, op, x, dy, res, cut, head_res, head_cut):
      y, res = chunk_forward(op["chunk"], x, _take(aux_all, op["mb"]))
      return out(acc, y=y, res=res)

    def f_first(acc, op, x, dy, res, cut, head_res, head_cut):
      return f(acc, op, embed_fn(embed_p, inputs[op["mb"]]), dy, res, cut, head_res, head_cut)

    def f_last(acc, op, x, dy, res, cut, head_res, head_cut):
      aux = _take(aux_all, op["mb"])
      y, res = chunk_forward(op["chunk"], x, aux)
      if backward:
        loss, head_res = head.forward(head_p, y, aux)
      else:
        loss, head_res = loss_fn(head_p, y, aux) * scale, None
      acc = {**acc, "loss": acc["loss"] + loss.astype(jnp.float32)}
      return out(acc, res=res, head_res=head_res)

    def b(acc, op, x, dy, res, cut, head_res, head_cut):
      dx, cut = chunk_backward_input(op["chunk"], res, _take(aux_all, op["mb"]), dy)
      return out(acc, dx=dx, cut=cut)

    def b_first(acc, op, x, dy, res, cut, head_res, head_cut):
      """B of chunk 0, continued into the embedding (a scatter-add: no W)."""
      acc, _, dx, _, cut, _, _ = b(acc, op, x, dy, res, cut, head_res, head_cut)
      _, vjp = jax.vjp(lambda p: embed_fn(p, inputs[op["mb"]]), embed_p)
      return out({**acc, "embed_g": _add(acc["embed_g"], vjp(dx)[0])}, cut=cut)

    def b_last(acc, op, x, dy, res, cut, head_res, head_cut):
      aux = _take(aux_all, op["mb"])
      seed = jnp.ones((), jnp.float32)
      dy, head_cut = head.backward_input(head_p, aux, head_res, _varying(seed, manual))
      dx, cut = chunk_backward_input(op["chunk"], res, aux, dy)
      return out(acc, dx=dx, cut=cut, head_cut=head_cut)

    def w(acc, op, x, dy, res, cut, head_res, head_cut):
      layer_g = chunk_backward_weight(op["chunk"], res, cut, _take(aux_all, op["mb"]))
      return out({**acc, "layers_g": _add_at(acc["layers_g"], op["chunk"], layer_g)})

    def w_last(acc, op, x, dy, res, cut, head_res, head_cut):
      acc = w(acc, op, x, dy, res, cut, head_res, head_cut)[0]
      head_g = head.backward_weight(head_p, _take(aux_all, op["mb"]), head_res, head_cut)
      return out({**acc, "head_g": _add(acc["head_g"], head_g)})

    branches = (idle, f, f_first, f_last, b, b_first, b_last, w, w_last)
    if not backward:  # a forward-only table indexes the first four
      branches = branches[:4]

    def tick(carry, row):
      acc, buffers, act_in, grad_in = carry
      op = {name: column[stage] for name, column in row.items()}
      buffers = {**buffers, "act": _put(buffers["act"], op["act_recv_slot"], act_in)}
      if backward:
        buffers["grad"] = _put(buffers["grad"], op["grad_recv_slot"], grad_in)
      reads = [_read(buffers[name], op[column]) for name, column in
               (("act", "act_slot"), ("grad", "grad_slot"), ("res", "res_slot"),
                ("cut", "cut_slot"), ("head_res", "head_res_slot"),
                ("head_cut", "head_cut_slot"))]
      acc, y, dx, *writes = lax.switch(op["branch"], branches, acc, op, *reads)
      is_f, is_b = op["op"] == schedules.F, op["op"] == schedules.B
      for name, column, when in (("res", "res_slot", is_f), ("cut", "cut_slot", is_b),
                                 ("head_res", "head_res_slot", is_f),
                                 ("head_cut", "head_cut_slot", is_b)):
        buffers[name] = _put(buffers[name], jnp.where(when, op[column], -1),
                             writes[("res", "cut", "head_res", "head_cut").index(name)])
      right = [(i, (i + 1) % num_stages) for i in range(num_stages)]
      left = [(i, (i - 1) % num_stages) for i in range(num_stages)]
      dx = lax.ppermute(dx, AXIS, left) if backward else dx
      return (acc, buffers, lax.ppermute(y, AXIS, right), dx), None

    stash_Lc = cut_Lc = head_stash = head_cut = []
    if backward:
      stash_Lc, cut_Lc = ([jax.ShapeDtypeStruct((num_layers, *s.shape), s.dtype) for s in structs]
                          for structs in (layer.stash, layer.cut))
      head_stash, head_cut = head.stash, head.cut
    zero_res, zero_cut, zero_head_res, zero_head_cut = (
        _varying(_zeros(s), manual) for s in (stash_Lc, cut_Lc, head_stash, head_cut))

    def buffer(structs, name):
      return _varying(_zeros(structs, (max(schedule.num_slots(name), 1),)), manual)

    buffers = {"act": buffer(x_struct, "act"), "grad": buffer(x_struct if backward else [], "grad"),
               "res": buffer(stash_Lc, "res"), "cut": buffer(cut_Lc, "cut"),
               "head_res": buffer(head_stash, "head_res"),
               "head_cut": buffer(head_cut, "head_cut")}
    # Float32 sums whatever the weights' dtype, so M microbatches of
    # bfloat16 gradients add up without rounding.
    acc = _varying({"layers_g": _zeros(layers_VxLc, dtype=jnp.float32),
                    "embed_g": _zeros(embed_p, dtype=jnp.float32),
                    "head_g": _zeros(head_p, dtype=jnp.float32),
                    "loss": jnp.zeros((), jnp.float32)}, manual)
    if not backward:
      acc = {"loss": acc["loss"]}
    (acc, *_), _ = lax.scan(tick, (acc, buffers, zeros_x, zeros_x), tables)
    loss = lax.psum(acc["loss"], summed)
    if not backward:
      return loss, None
    layers_g = acc["layers_g"]
    if split_axes:
      layers_g = lax.psum(layers_g, split_axes)
    return loss, {"embed": lax.psum(acc["embed_g"], summed),
                  "layers": jax.tree.map(lambda g: g[:, None], layers_g),
                  "head": lax.psum(acc["head_g"], summed)}

  whole, by_stage = PartitionSpec(*replica), PartitionSpec(*replica, None, AXIS)
  grads_spec = {"embed": whole, "layers": by_stage, "head": whole} if backward else None
  staged = functools.partial(to_stages, num_stages=num_stages, num_chunks=num_chunks)
  unstaged = from_stages
  if replica:  # the same per replica
    staged, unstaged = jax.vmap(staged), jax.vmap(unstaged)
  loss, grads = jax.shard_map(
      run, mesh=mesh, axis_names=set(manual),
      in_specs=(whole, by_stage, whole, batch_spec),
      out_specs=(whole, grads_spec),
  )(params["embed"], staged(params["layers"]), params["head"], microbatches)
  if grads is None:
    return loss, None
  return loss, {**grads, "layers": unstaged(grads["layers"])}
