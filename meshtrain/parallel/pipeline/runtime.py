"""One `shard_map` executor that runs any valid schedule table (`schedule.py`).

`pipeline_loss_and_grads` returns what `jax.value_and_grad` of the unpipelined
model gives for the mean loss over M microbatches, but runs the model as a
pipeline: manual over the `pipeline` mesh axis (and optionally the pure batch
axes), so the other axes (batch over fsdp, weights over fsdp/tensor) stay
automatic and GSPMD partitions the per-stage work as it would outside.

Inside, one `lax.scan` over the schedule's ticks. Each tick a stage
  1. writes the activation and gradient that arrived (sent last tick) into
     the slots `act_recv_slot` and `grad_recv_slot` name;
  2. runs its op: three two-way conditionals, F, B and W, of which at most
     one takes its branch. A branch reads the slots its op names, writes its
     stash slots, its output (F: one microbatch's activation, B: its input
     gradient) into a send buffer and adds into the gradient sums, all in
     place; the other branch hands the state back untouched, which XLA does
     without a copy. Every conditional returns the state alone;
  3. sends the activation right and the input gradient left on the ring,
     outside the op's conditionals, on the ticks after which some stage
     receives one (a static property of the table, so every stage takes the
     same send branch and runs the same collectives).
Each layer's backward is split into B and W (`split.split_vjp`): F keeps the
layer's vjp residuals (as the layer's `jax.checkpoint` policy decides) in the
`res` stash, B computes the input gradient and leaves what W needs in the
`cut` stash, W adds the weight gradients into the sums. Nothing runs twice
(but the part of an MoE layer's expert exchange that W needs: docs/moe.md):
the step does the FLOPs of the unpipelined step. (Why not one switch over
the ops: docs/pipeline.md, "What a tick moves".)

Model contract (any model, not only Llama):
  embed_fn(embed_params, inputs_BxL, aux) -> x_BxLxD
  layer_fn(layer_params, x_BxLxD, aux) -> (x_BxLxD, stats): one layer and
    the counts it reports beside its output ({} for none; an MoE layer's
    routing counts), which the executor sums per layer over the microbatches;
    a chunk is Lc layers stacked on a leading axis, scanned by the executor
  loss_fn(head_params, x_BxLxD, aux) -> (scalar mean loss, stats): the loss
    and the counts the head reports (like a layer's, {} for none; the
    multi-token prediction modules' of a Llama that has them), summed over
    the microbatches
`aux` is the microbatch's other [B, L, ...] arrays (targets, positions,
segment ids). Stage 0 runs `embed_fn` before chunk 0; the last stage runs
`loss_fn` after the last chunk and seeds the backward with d(loss / M). The pieces run
inside a partially manual `shard_map`, where XLA's partitioner aborts on some
gathers (docs/pipeline.md, "Model pieces inside the shard_map").
"""

import dataclasses
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
from meshtrain.parallel.pipeline.schedule import B, F, SLOT_FIELDS, W, Schedule
from meshtrain.parallel.pipeline.split import SplitVjp, split_vjp
from meshtrain.parallel.pipeline.stages import StageLayout

AXIS = "pipeline"
# The named scopes of a tick's conditionals (in the compiled program's op names).
SCOPES = ("pipeline_F", "pipeline_B", "pipeline_W", "pipeline_F_head", "pipeline_B_head",
          "pipeline_W_head", "pipeline_B_embed")


def cond_weights(schedule: Schedule) -> dict[str, float]:
  """Per conditional of a tick (by its named scope), the share of its runs
  that take the branch, averaged over stages: the weights
  `tests/compiled_flops.py`'s `dot_flops` needs. A nested one (the head's, the
  embedding's) counts among the runs of the branch it sits in."""
  op = schedule.op
  stage = np.arange(schedule.num_stages)[None, :]
  first = (stage == 0) & (schedule.chunk == 0)
  last = (stage == schedule.num_stages - 1) & (schedule.chunk == schedule.num_chunks - 1)
  runs = {kind: max(int((op == kind).sum()), 1) for kind in (F, B, W)}
  return {"pipeline_F": float((op == F).sum()) / op.size,
          "pipeline_B": float((op == B).sum()) / op.size,
          "pipeline_W": float((op == W).sum()) / op.size,
          "pipeline_F_head": float(((op == F) & last).sum()) / runs[F],
          "pipeline_B_head": float(((op == B) & last).sum()) / runs[B],
          "pipeline_W_head": float(((op == W) & last).sum()) / runs[W],
          "pipeline_B_embed": float(((op == B) & first).sum()) / runs[B]}


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


def _per_replica(restack: Callable[[Any], Any]) -> Callable[[Any], Any]:
  """`restack` applied to each leaf's slices along a leading replica axis."""
  return lambda tree: jax.tree.map(jax.vmap(restack), tree)


def _varying(tree: Any, axes: tuple[str, ...]) -> Any:
  """Types values invariant over `axes` as varying, as both branches'
  outputs must be (an invariant zero and a computed value do not match)."""
  def cast(x):
    varying = varying_axes(x)
    missing = tuple(a for a in axes if a not in varying)
    return lax.pcast(x, missing, to="varying") if missing else x
  return jax.tree.map(cast, tree)


def _take(tree: Any, i: jax.Array) -> Any:
  return jax.tree.map(lambda x: lax.dynamic_index_in_dim(x, i, 0, keepdims=False), tree)


def _start(index: tuple, ndim: int) -> tuple:
  """`index` then zeros, as one integer type (a table's int32 beside a loop
  counter that is int64 where float64 is on)."""
  return tuple(jnp.asarray(i, jnp.int32) for i in (*index, *(0,) * (ndim - len(index))))


def _at(tree: Any, *index: jax.Array) -> Any:
  """Each leaf at `index` of its leading dimensions."""
  def at(x):
    start = _start(index, x.ndim)
    return lax.dynamic_slice(x, start, (*(1,) * len(index), *x.shape[len(index):])).reshape(
        x.shape[len(index):])
  return jax.tree.map(at, tree)


def _read(buffers: Any, slot: jax.Array) -> Any:
  return _take(buffers, jnp.maximum(slot, 0))


def _write(buffers: Any, index: jax.Array | tuple, value: Any) -> Any:
  """`value` into each buffer at `index` of its leading dimensions (slots the
  table names: never -1)."""
  index = index if isinstance(index, tuple) else (index,)

  def write(buffer, x):
    start = _start(index, buffer.ndim)
    return lax.dynamic_update_slice(buffer, x.reshape(*(1,) * len(index), *x.shape).astype(
        buffer.dtype), start)
  return jax.tree.map(write, buffers, value)


def _arrive(buffers: Any, slot: jax.Array, value: Any) -> Any:
  """Writes what arrived into `slot` of each buffer; slot -1 writes nothing."""
  i = jnp.maximum(slot, 0)

  def put(buffer, x):
    kept = lax.dynamic_index_in_dim(buffer, i, 0, keepdims=False)
    return lax.dynamic_update_index_in_dim(buffer, jnp.where(slot >= 0, x, kept), i, 0)
  return jax.tree.map(put, buffers, value)


def _add_at(tree: Any, index: tuple, update: Any) -> Any:
  """`update` added into each leaf at `index` of its leading dimensions."""
  return _write(tree, index, _add(_at(tree, *index), update))


def _add(acc: Any, update: Any) -> Any:
  return jax.tree.map(lambda a, u: a + u.astype(a.dtype), acc, update)


def _zeros(structs: Any, lead: tuple[int, ...] = (), dtype=None) -> Any:
  return jax.tree.map(lambda s: jnp.zeros(lead + tuple(s.shape), dtype or s.dtype), structs)


def _unchanged(state: dict) -> dict:
  return state


def _branch(scope: str, taken: jax.Array, run: Callable, skipped: Callable, state: dict):
  """`lax.cond(taken, run, skipped, state)` under a named scope."""
  with jax.named_scope(scope):
    return lax.cond(taken, run, skipped, state)


@dataclasses.dataclass(frozen=True)
class Stage:
  """One stage's work inside the shard_map: the model pieces at its weights
  and the step's microbatches. Buffers and sums travel in a `state` dict
  (`initial_state`); each op takes a state and the tick's row of the table
  at this stage (`op`), and gives back a state."""
  index: jax.Array  # this stage, axis_index("pipeline")
  num_stages: int
  num_chunks: int
  embed_p: Any
  layers_VxLc: Any  # this stage's chunks, [V, Lc, ...] leaves (Lc slots)
  num_layers: int   # Lc, layer slots per chunk
  layer_counts: jax.Array | None  # [V, P] layers of each chunk, when not all Lc
  head_p: Any
  inputs: jax.Array  # [M, B, L]
  aux: dict          # the other [M, B, L] arrays
  embed_fn: Callable
  layer_fn: Callable
  loss_fn: Callable
  scale: float       # each microbatch's loss weighs 1 / (M x the devices splitting it)
  zeros_x: jax.Array  # one microbatch's activation, typed varying like every sent value
  manual: tuple[str, ...]
  layer: SplitVjp | None = None  # the layer's and the head's split backward (None: forward only)
  head: SplitVjp | None = None
  weight_specs: dict | None = None  # see pipeline_loss_and_grads

  def sent(self, x: jax.Array) -> jax.Array:
    """An activation or its gradient, typed like every value a stage sends."""
    return _varying(x, self.manual)

  def laid_out(self, state: dict) -> dict:
    """`state` with its gradient sums split over the automatic axes as the
    weights are (`weight_specs`; None: the state as it is)."""
    if self.weight_specs is None:
      return state
    specs = {"embed_g": self.weight_specs["embed"], "head_g": self.weight_specs["head"],
             "layers_g": jax.tree.map(lambda s: PartitionSpec(None, None, *s),  # [V, Lc, ...]
                                      self.weight_specs["layers"])}
    return {**state, **lax.with_sharding_constraint({k: state[k] for k in specs}, specs)}

  def first(self, op) -> jax.Array:
    return (self.index == 0) & (op["chunk"] == 0)

  def last(self, op) -> jax.Array:
    return (self.index == self.num_stages - 1) & (op["chunk"] == self.num_chunks - 1)

  def layer_weights(self, v, l):
    """Layer l of chunk v's weights."""
    return _at(self.layers_VxLc, v, l)

  def over_layers(self, op, body: Callable, carry, reverse: bool = False):
    """`carry` after `body(carry, l)` for each layer l of the op's chunk, the
    last first with `reverse`: a scan over the Lc slots where every chunk
    fills them, else a loop over the chunk's own layers (a stage with fewer
    runs fewer)."""
    if self.layer_counts is None:
      return lax.scan(lambda c, l: (body(c, l), None), carry, jnp.arange(self.num_layers),
                      reverse=reverse)[0]
    count = self.layer_counts[op["chunk"], self.index]
    return lax.fori_loop(0, count, lambda i, c: body(c, count - 1 - i if reverse else i), carry)

  def chunk_forward(self, op, x, aux, state: dict) -> tuple[jax.Array, dict]:
    """The chunk's layers on x, each layer's residuals written straight into
    the op's `res` slot and its counts added into its sums."""
    def body(carry, l):
      x, state = carry
      v = op["chunk"]
      p = self.layer_weights(v, l)
      if self.layer:
        y, res, stats = self.layer.forward(p, x, aux)
        state = {**state, "res": _write(state["res"], (op["res_slot"], l), res)}
      else:
        y, stats = self.layer_fn(p, x, aux)
      stats = _varying(stats, self.manual)
      return y, {**state, "stats": _add_at(state["stats"], (v, l), stats)}
    return self.over_layers(op, body, (x, state))

  def forward(self, op, state: dict) -> dict:
    """F: the chunk on its input (the embedding's output on chunk 0), its
    residuals into the `res` slot, its output into `send_act`; after the last
    chunk the head and the loss."""
    def run(state):
      aux = _take(self.aux, op["mb"])
      # A select, not a conditional: XLA requires both branches of one to lay
      # out their results alike, and the embedding's layout is the model's.
      x = jnp.where(self.first(op), self.embed_fn(self.embed_p, self.inputs[op["mb"]], aux),
                    _read(state["act"], op["act_slot"]))
      y, state = self.chunk_forward(op, x, aux, state)

      def head(state):
        if not self.head:
          loss, stats = self.loss_fn(self.head_p, y, aux)
          state = {**state, "loss": state["loss"] + loss * self.scale}
        else:
          loss, head_res, stats = self.head.forward(self.head_p, y, aux)
          state = {**state, "loss": state["loss"] + loss.astype(jnp.float32),
                   "head_res": _write(state["head_res"], op["head_res_slot"], head_res)}
        return {**state, "head_stats": _add(state["head_stats"], _varying(stats, self.manual))}
      state = _branch("pipeline_F_head", self.last(op), head, _unchanged, state)
      return {**state, "send_act": self.sent(y)}
    return _branch("pipeline_F", op["op"] == F, run, _unchanged, state)

  def backward_input(self, op, state: dict) -> dict:
    """B: the chunk's input gradient from its output gradient (the loss's on
    the last chunk) into `send_grad`, what W needs into the `cut` slot;
    before chunk 0 the embedding's weight gradient (a scatter-add: no W)."""
    def run(state):
      aux = _take(self.aux, op["mb"])

      def from_loss(state):  # its gradient lands in `send_grad`, which B overwrites with dx
        seed = _varying(jnp.ones((), jnp.float32), self.manual)
        dy, head_cut = self.head.backward_input(
            self.head_p, aux, _read(state["head_res"], op["head_res_slot"]), seed)
        return {**state, "send_grad": self.sent(dy),
                "head_cut": _write(state["head_cut"], op["head_cut_slot"], head_cut)}
      # Conditionals here return the state alone: one that also returned dy
      # made XLA copy whole buffers around it.
      state = _branch("pipeline_B_head", self.last(op), from_loss, _unchanged, state)
      dy = jnp.where(self.last(op), state["send_grad"], _read(state["grad"], op["grad_slot"]))

      def body(carry, l):  # each layer's cut written straight into the op's slot
        dy, state = carry
        dx, cut = self.layer.backward_input(self.layer_weights(op["chunk"], l), aux,
                                            _at(state["res"], op["res_slot"], l), dy)
        return dx, {**state, "cut": _write(state["cut"], (op["cut_slot"], l), cut)}
      dx, state = self.over_layers(op, body, (dy, state), reverse=True)

      def into_embedding(state):
        _, vjp = jax.vjp(lambda p: self.embed_fn(p, self.inputs[op["mb"]], aux), self.embed_p)
        return {**state, "embed_g": _add(state["embed_g"], vjp(dx)[0])}
      state = _branch("pipeline_B_embed", self.first(op), into_embedding, _unchanged, state)
      return {**state, "send_grad": self.sent(dx)}
    return _branch("pipeline_B", op["op"] == B, run, _unchanged, state)

  def backward_weight(self, op, state: dict) -> dict:
    """W: the chunk's weight gradients (and the head's after the last chunk)
    from its residuals and B's cut, added into the sums."""
    def run(state):
      aux = _take(self.aux, op["mb"])

      def body(layers_g, l):  # each layer's gradients added where they are summed
        v = op["chunk"]
        g = self.layer.backward_weight(self.layer_weights(v, l), aux,
                                       _at(state["res"], op["res_slot"], l),
                                       _at(state["cut"], op["cut_slot"], l))
        return _add_at(layers_g, (v, l), g)
      layers_g = self.over_layers(op, body, state["layers_g"])
      state = {**state, "layers_g": layers_g}

      def head(state):
        head_g = self.head.backward_weight(self.head_p, aux,
                                           _read(state["head_res"], op["head_res_slot"]),
                                           _read(state["head_cut"], op["head_cut_slot"]))
        return {**state, "head_g": _add(state["head_g"], head_g)}
      return _branch("pipeline_W_head", self.last(op), head, _unchanged, state)
    return _branch("pipeline_W", op["op"] == W, run, _unchanged, state)

  def tick(self, state: dict, row: dict) -> tuple[dict, None]:
    """One tick of the table: arrivals, this stage's op, the two sends; the
    gradient sums come out `laid_out` (the loop then carries them so)."""
    sends = row.pop("sends")  # [act, grad]: whether any stage receives one next tick
    op = {name: column[self.index] for name, column in row.items()}
    state = {**state, "act": _arrive(state["act"], op["act_recv_slot"], state["act_in"])}
    state = self.forward(op, state)
    state = self.send(sends[0], state, "send_act", "act_in", +1)
    if self.layer:
      state["grad"] = _arrive(state["grad"], op["grad_recv_slot"], state["grad_in"])
      state = self.backward_weight(op, self.backward_input(op, state))
      state = self.laid_out(self.send(sends[1], state, "send_grad", "grad_in", -1))
    return state, None

  def send(self, needed: jax.Array, state: dict, out: str, arrived: str, step: int) -> dict:
    """Every stage sends `out` one step along the ring (+1 right, -1 left)
    where the tick's row says some stage receives one: the same on every
    stage, so every stage runs the same collectives. What a stage that ran
    no F (B) sends lands in no slot."""
    pairs = [(i, (i + step) % self.num_stages) for i in range(self.num_stages)]

    def exchange(state):
      return {**state, arrived: lax.ppermute(state[out], AXIS, pairs)}
    return lax.cond(needed, exchange, _unchanged, state)


def initial_state(stage: Stage, schedule: Schedule) -> dict:
  """Zero buffers, each with the slots the table uses, and zero float32 sums
  (whatever the weights' dtype, so M microbatches of bfloat16 gradients add
  up without rounding); forward only: the activations and the loss."""
  x = stage.zeros_x

  def buffer(structs, name, lead=()):
    """Zero slots typed like the values they hold: activations vary over every
    manual axis, a stashed residual over those it varied over when traced."""
    lead = (max(schedule.num_slots(name), 1), *lead)

    def zeros(s):
      traced = isinstance(s, jax.ShapeDtypeStruct)
      return _varying(jnp.zeros(lead + tuple(s.shape), s.dtype),
                      varying_axes(s) if traced else stage.manual)
    return jax.tree.map(zeros, structs)
  one_layer = jax.tree.map(lambda w: w[0, 0], stage.layers_VxLc)
  aux0 = _take(stage.aux, 0)
  stats = stage.layer.stats if stage.layer else jax.eval_shape(
      stage.layer_fn, one_layer, x, aux0)[1]
  head_stats = stage.head.stats if stage.head else jax.eval_shape(
      stage.loss_fn, stage.head_p, x, aux0)[1]
  chunks = jax.tree.leaves(stage.layers_VxLc)[0].shape[0]
  state = {"act": buffer(x, "act"), "act_in": x, "send_act": x,
           "loss": _varying(jnp.zeros((), jnp.float32), stage.manual),
           "stats": _varying(_zeros(stats, (chunks, stage.num_layers), jnp.float32),
                             stage.manual),
           "head_stats": _varying(_zeros(head_stats, dtype=jnp.float32), stage.manual)}
  if stage.layer is None:
    return state
  num_layers = stage.num_layers
  sums = {"layers_g": stage.layers_VxLc, "embed_g": stage.embed_p, "head_g": stage.head_p}
  return {**state, "grad": buffer(x, "grad"), "grad_in": x, "send_grad": x,
          "res": buffer(stage.layer.stash, "res", (num_layers,)),
          "cut": buffer(stage.layer.cut, "cut", (num_layers,)),
          "head_res": buffer(stage.head.stash, "head_res"),
          "head_cut": buffer(stage.head.cut, "head_cut"),
          **_varying({k: _zeros(v, dtype=jnp.float32) for k, v in sums.items()}, stage.manual)}


def _run(schedule: Schedule, layout: StageLayout, pieces: dict, split_axes: tuple[str, ...],
         manual: tuple[str, ...], scale: float, weight_specs: dict | None, embed_p, layers_VxLc,
         head_p, microbatches: dict):
  """One device's share of the pipeline: (loss, grads, its layers' counts,
  the head's counts) summed over its stage (gradients None for a
  forward-only table)."""
  microbatches = _varying(microbatches, (AXIS,))  # every stage has them, typed like activations
  embed_p, head_p = _varying((embed_p, head_p), manual)
  aux = {k: v for k, v in microbatches.items() if k != "inputs"}
  x_struct = jax.eval_shape(pieces["embed_fn"], embed_p, microbatches["inputs"][0],
                            _take(aux, 0))
  stage = Stage(lax.axis_index(AXIS), schedule.num_stages, schedule.num_chunks, embed_p,
                layers_VxLc, layout.slots,
                None if layout.even_split else jnp.asarray(layout.counts_VxP()), head_p,
                microbatches["inputs"], aux, **pieces, scale=scale,
                zeros_x=_varying(jnp.zeros(x_struct.shape, x_struct.dtype), manual),
                manual=manual, weight_specs=weight_specs)
  if schedule.has_backward:  # the vjps are traced where they run, at one layer's shapes
    aux0, one_layer = _take(aux, 0), jax.tree.map(lambda x: x[0, 0], layers_VxLc)
    stage = dataclasses.replace(
        stage, layer=split_vjp(pieces["layer_fn"], one_layer, stage.zeros_x, aux0),
        head=split_vjp(lambda p, x, a: _scaled(pieces["loss_fn"](p, x, a), scale), head_p,
                       stage.zeros_x, aux0))
  tables = {name: getattr(schedule, name) for name in ("op", "mb", "chunk", *SLOT_FIELDS)}
  tables["sends"] = schedule.sends()
  state, _ = lax.scan(stage.tick, initial_state(stage, schedule), tables)
  summed = (AXIS, *split_axes)
  loss = lax.psum(state["loss"], summed)
  # A layer's counts are the whole microbatch's (its token sums span the
  # devices that split it), alike on those devices: their mean is them.
  split = math.prod(lax.axis_size(a) for a in split_axes)
  def mean(s):
    return lax.psum(s, split_axes) / split if split_axes else s
  stats = jax.tree.map(lambda s: mean(s)[:, None], state["stats"])
  head_stats = jax.tree.map(lambda s: mean(lax.psum(s, AXIS)), state["head_stats"])
  if stage.layer is None:
    return loss, None, stats, head_stats
  layers_g = lax.psum(state["layers_g"], split_axes) if split_axes else state["layers_g"]
  return loss, {"embed": lax.psum(state["embed_g"], summed),
                "layers": jax.tree.map(lambda g: g[:, None], layers_g),
                "head": lax.psum(state["head_g"], summed)}, stats, head_stats


def _scaled(loss_and_stats: tuple[jax.Array, Any], scale: float) -> tuple[jax.Array, Any]:
  loss, stats = loss_and_stats
  return loss * scale, stats


def _check(schedule: Schedule, layout: StageLayout, mesh: Mesh,
           microbatches: dict[str, jax.Array]) -> None:
  if schedule.placement != "loop":
    raise ValueError(f"{schedule.name} places its chunks on the V, which this runtime does not "
                     "run yet")
  if mesh.shape[AXIS] != schedule.num_stages:
    raise ValueError(f"schedule has {schedule.num_stages} stages but the mesh has "
                     f"pipeline={mesh.shape[AXIS]}")
  if (layout.num_stages, layout.num_chunks) != (schedule.num_stages, schedule.num_chunks):
    raise ValueError(f"the layout has {layout.num_stages} stages x {layout.num_chunks} chunks, "
                     f"the schedule {schedule.num_stages} x {schedule.num_chunks}")
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
    replica_axis: str | None = None,
    layout: StageLayout | None = None,
    weight_specs: dict[str, Any] | None = None) -> tuple[jax.Array, dict[str, Any] | None]:
  """Mean loss over the M microbatches and its gradients, run by `schedule`.

  Args:
    schedule: a valid table with P = mesh.shape["pipeline"] stages, M
      microbatches and V chunks per stage. A forward-only table
      (`schedule.forward_only`) gives the loss and None for the gradients.
    mesh: the device mesh.
    embed_fn, layer_fn, loss_fn: the model in three pieces (module docstring).
    params: {"embed": ..., "layers": ..., "head": ...} pytrees. `layers`
      leaves stack P*V*Lc layers on a leading axis; chunk c = v*P + s (on
      stage s) is layers [c*Lc, (c+1)*Lc) (`to_stages`); with an uneven
      `layout`, its P*V*Lc slots (`layout.to_slots`). `embed` and `head`
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
    layout: how many layers each chunk runs (`stages.StageLayout`); None:
      the even split of the `layers` leaves.
    weight_specs: the weights' PartitionSpecs over the automatic axes, a
      tree like `params` (a layer's without the stacked axis, no replica
      dimension): the float32 gradient sums are split as they say through
      the ticks. None: where XLA's propagation puts them (beside a manual
      batch axis, whole over `fsdp`).

  Returns:
    (loss, grads, stats, head_stats): float32, grads shaped like params.
    Embed and head gradients are summed over `pipeline` once, after the last
    tick (only stage 0, resp. P-1, has a nonzero one): one all-reduce per step
    instead of a collective per tick, and none inside a branch that only some
    stages take. `stats`: each layer's counts summed over the microbatches, stacked
    like the layers ([P*V*Lc, ...] leaves, the layout's slots); `head_stats`
    the head's, summed over the microbatches.
  """
  # Axes that split the microbatch but no weight: each device sums its own gradients.
  split_axes = (*batch_axes, *([length_axis] if length_axis else []))
  replica = (replica_axis,) if replica_axis else ()
  if layout is None:
    layers = jax.tree.leaves(params["layers"])[0].shape[len(replica)]
    layout = StageLayout.even(layers, schedule.num_stages, schedule.num_chunks)
  _check(schedule, layout, mesh, microbatches)
  manual = (AXIS, *split_axes, *replica)
  # Each device's loss is the mean over its equal share of a microbatch.
  scale = 1 / (schedule.num_microbatches * math.prod(mesh.shape[a] for a in split_axes))
  run = functools.partial(_run, schedule, layout, dict(embed_fn=embed_fn, layer_fn=layer_fn,
                                                       loss_fn=loss_fn), split_axes, manual, scale,
                          weight_specs)
  return _over_devices(run, schedule, mesh, manual, params, microbatches,
                       batch_spec=PartitionSpec(None, (*batch_axes, *replica) or None, length_axis),
                       replica=replica)


def _over_devices(run: Callable, schedule: Schedule, mesh: Mesh, manual: tuple[str, ...],
                  params: dict[str, Any], microbatches: dict[str, jax.Array], *,
                  batch_spec: PartitionSpec, replica: tuple[str, ...]):
  """`run` (`_run` with the pieces bound) on each device under `shard_map`,
  manual over `manual`: the layers cut into stages going in and put back
  in model order coming out (per replica with a `replica` axis)."""
  varying = tuple(a for a in manual if a != AXIS)  # the layers' copies differ along these

  def device(embed_p, layers_Vx1xLc, head_p, microbatches):
    if replica:  # this device's replica
      embed_p, layers_Vx1xLc, head_p = jax.tree.map(lambda x: x[0],
                                                    (embed_p, layers_Vx1xLc, head_p))
    layers_VxLc = _varying(jax.tree.map(lambda x: x[:, 0], layers_Vx1xLc), varying)
    out = run(embed_p, layers_VxLc, head_p, microbatches)
    return jax.tree.map(lambda x: x[None], out) if replica else out

  whole, by_stage = PartitionSpec(*replica), PartitionSpec(*replica, None, AXIS)
  grads_spec = {"embed": whole, "layers": by_stage, "head": whole} if schedule.has_backward else None
  staged = functools.partial(to_stages, num_stages=schedule.num_stages,
                             num_chunks=schedule.num_chunks)
  unstaged = from_stages
  if replica:  # the same per replica, leaf by leaf (a tree may be empty)
    staged, unstaged = _per_replica(staged), _per_replica(unstaged)
  loss, grads, stats, head_stats = jax.shard_map(
      device, mesh=mesh, axis_names=set(manual),
      in_specs=(whole, by_stage, whole, batch_spec),
      out_specs=(whole, grads_spec, by_stage, whole),
  )(params["embed"], staged(params["layers"]), params["head"], microbatches)
  stats = unstaged(stats)
  if grads is None:
    return loss, None, stats, head_stats
  return loss, {**grads, "layers": unstaged(grads["layers"])}, stats, head_stats
