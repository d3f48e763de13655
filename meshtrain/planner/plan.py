"""Per-device memory and per-step communication of a config: an analytic model
derived from the rules tables, and the same figures read from the compiled step.

The analytic model follows each weight through the three layouts of
`rules.ShardingRules` (see `meshtrain.train.step`):

  master (optimizer layout) --all-gather over axes it drops--> working copy
  working copy --all-gather over its batch axes, per layer and pass--> compute
  gradient --reduce-scatter over the `grads` batch axes, per microbatch--> accumulator
  accumulator --all-reduce (or reduce-scatter into the optimizer layout) over
      the remaining batch axes, once per step--> optimizer

(a pipeline's stages keep float32 sums instead, reduced after the last tick:
`state_memory.pipeline_sums`).

"Batch axes" are the mesh axes that split the batch (`data`, `fsdp`); the other
axes a weight is split over (`tensor`) stay split in compute. Uneven pipeline
stages (`config.pipeline.stage_layers`) hold every chunk in the largest
chunk's slots and make the step wait for the fullest stage (`stage_layers`).
Activations move too (`_activation_traffic`): Megatron's collectives under `tensor`, attention's
under `sequence`, the pipeline's sends between stages. Bytes follow the ring
convention of `meshtrain.analysis.hlo`. Activations are what the model itself
saves for its backward (`meshtrain.planner.residuals`: the residuals of
`jax.vjp` on abstract values, each in its layout on the mesh), embedding, head
and logits included; docs/memory_plan.md sets them beside Korthikanti et
al.'s formulas.
"""

import collections
import dataclasses
import functools
import math
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AbstractMesh, AxisType

from meshtrain import gpu_targets, rules as r
from meshtrain.analysis import gpu_program, hlo
from meshtrain.mesh import AXES, axis_sizes
from meshtrain.models import flops, mla
from meshtrain.parallel import experts, float8, sequence
from meshtrain.parallel.pipeline.split import split_vjp
from meshtrain.planner import clusters, costs, residuals
from meshtrain.train import local_sgd, pipelined, setup as setup_lib
from meshtrain.train.loss import model_loss, with_loss_weights
from meshtrain.train.parallelize import (Execution, attention_kernel, execution_for, llama_spec,
                                         model_config, run_device, slots, stage_layout)
from meshtrain.train.run import resolve
from meshtrain.train.state import merged
from meshtrain.train.state_memory import BATCH_AXES, leaf_layouts, prod, sizes, state_bytes


def abstract_mesh(mesh_cfg, num_devices: int) -> AbstractMesh:
  axis_size = axis_sizes(mesh_cfg, num_devices)
  return AbstractMesh(tuple(axis_size[a] for a in AXES), AXES,
                      axis_types=(AxisType.Auto,) * len(AXES))


def _length_axes(rules: r.ShardingRules, mesh) -> set[str]:
  """The mesh axes that split the residual stream's length (`sequence`, and
  `tensor` under Megatron-SP), by the rules the model traces under."""
  return {a for a in dict(rules.params).get(r.RES_LENGTH, ()) if sizes(mesh)[a] > 1}


def _sequence_parallel(rules: r.ShardingRules, mesh) -> bool:
  """Whether the residual stream comes split by the length over `tensor`
  (Megatron-SP)."""
  return "tensor" in _length_axes(rules, mesh)


@functools.lru_cache(maxsize=None)
def _label(axes: frozenset) -> str:
  return "+".join(a for a in AXES if a in axes)


class _Comm:
  """Analytic collectives on one mesh, summed by (kind, axis)."""

  def __init__(self, mesh):
    self.sizes = sizes(mesh)
    self.totals = collections.defaultdict(lambda: [0, 0])

  def add(self, kind: str, axes, operand_bytes: float, count: float = 1) -> None:
    n = 1
    for a in axes:
      n *= self.sizes[a]
    if n == 1 or operand_bytes == 0:
      return
    if kind == "all-reduce":
      per_op = 2 * operand_bytes * (n - 1) / n
    elif kind == "collective-permute":
      per_op = operand_bytes
    else:  # all-gather (the operand: the gathered output), reduce-scatter, all-to-all
      per_op = operand_bytes * (n - 1) / n
    total = self.totals[(kind, _label(frozenset(axes)))]
    total[0] += count
    total[1] += per_op * count

  def as_list(self) -> list[dict]:
    return [{"kind": k, "axis": a, "count": c, "bytes": int(b)}
            for (k, a), (c, b) in sorted(self.totals.items())]


def analytic(cfg, spec, rules: r.ShardingRules, mesh, activations: int | None = None,
             collectives: bool = True, layouts: list | None = None) -> dict:
  """Per-device memory (bytes) and per-step collectives of the train step;
  `activations=0` leaves out the traced activation and backward bytes (the
  search scales its own), `collectives=False` the collectives. Memory is the
  device's through the forward and backward; with `config.offload` the state
  it keeps in pinned host memory is `host`, outside `total` (the update
  brings it to the device). `layouts`: `leaf_layouts`' own, when already read."""
  param_bytes = jnp.dtype(cfg.param_dtype).itemsize
  grad_bytes = jnp.dtype(cfg.grad_dtype).itemsize
  accum = cfg.grad_accum_steps
  axis_size = sizes(mesh)
  batch_axes = {a for a in BATCH_AXES if axis_size[a] > 1}
  # Gradients are summed over every axis that splits the tokens (with sequence
  # parallelism `tensor` too, for the weights it does not split: norm scales).
  length_axes = _length_axes(rules, mesh)
  token_axes = batch_axes | length_axes
  per_replica = accum > 1 and "data" in batch_axes
  pipelined = axis_size["pipeline"] > 1
  microbatches = cfg.pipeline.microbatches if pipelined else 1

  layouts = layouts or leaf_layouts(cfg, spec, rules, mesh)
  state = state_bytes(cfg, spec, rules, mesh, layouts)
  host = state["host"]  # what `config.offload` keeps in pinned host memory
  memory = {"params": state["params"], "grads": state["grads"], "optimizer": state["optimizer"],
            "activations": 0.0, "backward": 0.0}
  comm = _Comm(mesh)
  for leaf in layouts if collectives else ():
    p_axes, g_axes, o_axes, gathered = leaf.params, leaf.grads, leaf.optimizer, leaf.gathered
    comm.add("all-gather", o_axes - p_axes, param_bytes * leaf.working)
    comm.add("all-gather", p_axes & gathered,
             _gathered_bytes(leaf.names, cfg, param_bytes) * leaf.compute / leaf.layers,
             _gathers(leaf.names, cfg, pipelined and "fsdp" in p_axes & gathered))
    # Inside a pipeline a layer's gradients split over `fsdp` (automatic
    # there) are reduce-scattered in every microbatch's W.
    comm.add("reduce-scatter", g_axes & gathered, param_bytes * leaf.compute / leaf.layers,
             accum * leaf.layers * (microbatches if leaf.layers > 1
                                    and "fsdp" in g_axes & gathered else 1))
    rest = token_axes - g_axes
    reductions = 1 if accum == 1 or per_replica else accum
    # The gradient before its reduction: with one microbatch `grads` is already
    # the optimizer's shard, with accumulation the whole accumulator.
    reduced = ((grad_bytes if per_replica else param_bytes) * leaf.grads_kept
               * (prod(rest & o_axes, mesh) if accum == 1 else 1))
    comm.add("reduce-scatter", rest & o_axes, reduced, reductions)
    # The sums over the length axes complete inside the layer that makes them,
    # apart from those over the batch axes (XLA's partitioner, not one union).
    for axes in (rest - o_axes) & length_axes, rest - o_axes - length_axes:
      comm.add("all-reduce", axes, reduced / prod(rest & o_axes, mesh), reductions)

  if activations is None:
    memory["activations"] = activation_bytes(cfg, mesh, rules)
    memory["backward"] = backward_bytes(cfg, mesh, rules)
  report = {}
  if collectives:
    _activation_traffic(cfg, mesh, comm, length_axes)
    report["collectives"] = comm.as_list()
  if cfg.local_sgd.inner_steps:  # replicas step alone; one delta all-reduce per sync
    memory["local_sgd_outer"] = state["local_sgd_outer"]
    if collectives:
      report["collectives"] = ([c for c in report["collectives"] if "data" not in c["axis"]]
                               + [local_sgd.plan(cfg, spec, rules, mesh)["sync"]])
  memory["total"] = sum(memory.values())
  if host:
    memory["host"] = host
  if activations is None and cfg.remat == "offload":
    memory["host_activations"] = activation_bytes(cfg, mesh, rules, on_host=True)
  return {"memory_bytes": {k: int(v) for k, v in memory.items()}, **report}


def _gathered_bytes(names: tuple, cfg, param_bytes: int) -> int:
  """Bytes an element of a weight is all-gathered in: a projection under a
  `config.float8` recipe of float8 GEMMs (`float8.float8_gemms`,
  `float8.runs_in_float8`) in float8, quantized on its shard before the
  gather (where XLA puts the quantization: docs/float8.md), else the
  working dtype."""
  return 1 if float8.float8_gemms(cfg.float8) and float8.runs_in_float8(names) else param_bytes


def _activation_traffic(cfg, mesh, comm: _Comm, length_axes: set[str]) -> None:
  """Collectives of activations, per step and device, the residual stream's
  length split over `length_axes`.

  Per layer and microbatch, each forward of an attention or MLP block under
  `tensor` all-reduces its output (Megatron), or under Megatron-SP
  all-gathers its input and reduce-scatters its output; its backward does the
  transpose, and re-gathers the input it kept split (under full recomputation
  the recomputed forward's gather serves it: with no optimisation barrier in
  the recomputation XLA merges the two). A layer runs
  its forward once, and again under full recomputation, where the recomputed
  block's last reduce-scatter is dead code. The embedding lookup in a
  vocabulary-split table and the head's input gradient are summed over
  `tensor` once each (reduce-scattered under Megatron-SP, where the head's
  input and the lookup's gradient are all-gathered), and the vocabulary-split
  cross-entropy all-reduces three float32 numbers per token (Megatron's
  vocab-parallel loss). Under `sequence` attention moves K and V
  (`_sequence_attention`). A pipeline sends one activation right and one
  gradient left every tick, and its W (the weight gradients, split from B)
  gathers a block's input once more.
  """
  m = cfg.model
  act_bytes = jnp.dtype(cfg.compute_dtype).itemsize
  axis_size = sizes(mesh)
  stages, t = axis_size["pipeline"], axis_size["tensor"]
  sequence_parallel = "tensor" in length_axes
  microbatches = cfg.pipeline.microbatches if stages > 1 else 1
  rows = cfg.global_batch // cfg.grad_accum_steps // microbatches // prod(
      [a for a in BATCH_AXES if axis_size[a] > 1], mesh)
  s = cfg.seq_len // axis_size["sequence"]
  activation = act_bytes * rows * s * m.embed_dim
  passes = cfg.grad_accum_steps * microbatches
  forwards = 1 + (cfg.remat == "full")  # a pipeline's B recomputes nothing
  layer_passes = stage_layers(cfg)[0] * passes
  # The routed layers the busiest stage runs, round by round (`stage_layers`).
  routed_passes = passes * (int(stage_layout(cfg).counts_VxP().max(axis=1).sum())
                            if m.moe.num_experts else 0)
  # Megatron's MLP blocks: every layer's but the routed ones without a shared expert.
  mlp_passes = layer_passes - (0 if m.moe.shared_mlp_dim else routed_passes)
  block_passes = layer_passes + mlp_passes
  # Multi-head Latent Attention's backward sums its latents' gradients over
  # `tensor` (whole, as its down-projections are), not the block input's.
  latent = m.mla.q_lora_rank + m.mla.kv_lora_rank + m.mla.rope_head_dim if m.mla.kv_lora_rank else 0
  summed_on_latents = layer_passes if latent else 0
  if sequence_parallel:
    # Under full recomputation the backward's gather is the recomputed one's.
    gathers = forwards + 2 - (cfg.remat == "full") + (stages > 1)  # a pipeline's W: once more
    comm.add("all-gather", {"tensor"}, activation,
             gathers * block_passes - summed_on_latents + 2 * passes)
    comm.add("reduce-scatter", {"tensor"}, activation,
             (forwards + 1) * block_passes - (cfg.remat == "full") * mlp_passes + 2 * passes
             - summed_on_latents)
  else:
    comm.add("all-reduce", {"tensor"}, activation,
             (forwards + 1) * block_passes + 2 * passes - summed_on_latents)
  if latent and t > 1:
    comm.add("all-reduce", {"tensor"}, activation / m.embed_dim * latent, summed_on_latents)
  if t > 1:  # the vocabulary-split cross-entropy: max, sum of exponentials, target logit
    comm.add("all-reduce", {"tensor"}, 4 * rows * s, 3 * passes)
  if axis_size["sequence"] > 1:
    _sequence_attention(cfg, mesh, comm, rows, forwards, layer_passes, passes)
  if m.moe.num_experts:
    _expert_dispatch(cfg, mesh, comm, rows, s, forwards, routed_passes, length_axes)
  if stages > 1:
    # Every stage sends after the ticks where some stage receives (runtime.py).
    sends = round(costs.table_counts(cfg.pipeline.schedule, stages, microbatches,
                                     cfg.pipeline.virtual_stages).sends)
    sent = activation / (t if sequence_parallel else 1)
    comm.add("collective-permute", {"pipeline"}, sent, sends * cfg.grad_accum_steps)


def _sequence_attention(cfg, mesh, comm: _Comm, rows: int, forwards: float,
                        layer_passes: int, passes: int) -> None:
  """K/V traffic of context-parallel attention (`meshtrain.parallel.sequence`),
  per forward and backward of every layer. Sizes are one device's blocks."""
  m, axis_size = cfg.model, sizes(mesh)
  n, t = axis_size["sequence"], axis_size["tensor"]
  act_bytes, tokens = jnp.dtype(cfg.compute_dtype).itemsize, rows * cfg.seq_len // n
  token_bytes = act_bytes * tokens * mla.widths(m)[2]  # the padded width
  split = lambda heads: heads // t if heads % t == 0 else heads  # noqa: E731
  q, kv = token_bytes * split(m.num_heads), token_bytes * split(m.num_kv_heads)
  strategy = cfg.attention.sequence_strategy
  if strategy == "all_gather_kv":
    # K and V gathered whole in each forward and again for the backward (the
    # partitioner keeps their shards, not the gathered copies); dK and dV
    # scattered back.
    comm.add("all-gather", {"sequence"}, n * kv, 2 * (forwards + 1) * layer_passes)
    comm.add("reduce-scatter", {"sequence"}, 2 * n * kv, layer_passes)
  elif strategy == "ulysses":  # q, k, v to head sharding and the output back, both ways
    repeated = token_bytes * split(sequence.ulysses_kv_heads(m.num_heads, m.num_kv_heads, n, t))
    for size in (q, repeated, repeated, q):
      comm.add("all-to-all", {"sequence"}, size, (forwards + 1) * layer_passes)
  else:  # ring: n - 1 K/V blocks each forward, n - 1 dK/dV blocks back
    comm.add("collective-permute", {"sequence"}, 2 * kv, (n - 1) * (forwards + 1) * layer_passes)
    # The batch comes in zigzag order: its int32 inputs and targets (and the
    # segment ids and positions of packed documents) are permuted once per pass.
    moving = sum(any(s != d for s, d in pairs) for pairs in sequence.zigzag_pairs(n)) / 2
    arrays = 4 if cfg.data.packing == "segments" else 2
    comm.add("collective-permute", {"sequence"}, moving * 4 * tokens, arrays * passes)


def _expert_dispatch(cfg, mesh, comm: _Comm, rows: int, length: int, forwards: int,
                     moe_passes: int, length_axes: set[str]) -> None:
  """What `meshtrain.parallel.experts` moves, per forward and backward of
  every MoE layer on one device's `rows` x `length` tokens: the buckets of
  tokens to their experts' devices and the outputs back, in the compute
  dtype (twice each way: forward, and the transposes in the backward, where a
  pipeline's W sends the output gradients once more: docs/moe.md), and the
  [n, E_local] counts (each forward). A ragged dispatch sends the assignments'
  rows alone, which on balanced routing (what the plan assumes) are the
  device's T x K, and its senders' offsets with the counts.

  Under `tensor`, each tensor device dispatches its share of the tokens
  where that makes the buckets no bigger (`experts.tensor_split`): the rows
  that arrive are all-gathered over `tensor` for its slices of the experts
  (with their int32 experts, each forward) and
  the partial outputs reduce-scattered back (and the transposes in the
  backward, W gathering the output gradients once more); without Megatron-SP
  the layer's output and its input gradient are all-gathered from the
  shares, with it a share of the batch is taken from its split of the length
  by all-to-alls. Else every tensor device dispatches every token, and the
  partial outputs and the input gradient are summed.

  With a capacity, the routing gathers along the length each chunk's count
  per expert (int32), where the length is split."""
  moe, m, axis_size = cfg.model.moe, cfg.model, sizes(mesh)
  t, sequence_parallel = axis_size["tensor"], "tensor" in length_axes
  axes = [a for a in cfg.expert_parallel.split(",") if a and axis_size[a] > 1]
  n = prod(axes, mesh)
  local = moe.num_experts // n
  per_sequence = model_config(cfg).moe.capacity(cfg.seq_len)
  split = experts.tensor_split(rows, length, t, moe.experts_per_token, local, per_sequence)
  capacity = experts.share_capacity(rows, length, t, split, moe.experts_per_token, local,
                                    per_sequence)
  act_bytes = jnp.dtype(cfg.compute_dtype).itemsize
  bucket = act_bytes * n * capacity * m.embed_dim
  w_resends = axis_size["pipeline"] > 1
  ragged = cfg.experts.dispatch == "ragged" and n > 1
  if ragged:  # the rows alone, (n - 1) / n of a device's assignments on balanced routing
    sent = act_bytes * rows * length // (t if split else 1) * moe.experts_per_token * m.embed_dim
  comm.add("all-to-all", set(axes), sent if ragged else bucket,
           (2 * (forwards + 1) + w_resends) * moe_passes)
  comm.add("all-to-all", set(axes), 4 * n * (local + ragged), forwards * moe_passes)
  if ragged:  # jax's transpose of a ragged all-to-all sends its two offset vectors first
    comm.add("all-to-all", set(axes), 4 * n, 2 * (2 + w_resends) * moe_passes)
  if per_sequence:  # each chunk's count per expert, for the capacity (`sequence.count_before`)
    ring = axis_size["sequence"] if cfg.attention.sequence_strategy == "ring" else 0
    chunks = sequence.prefix_chunks(cfg.seq_len, prod(length_axes, mesh), ring)
    comm.add("all-gather", length_axes, 4 * rows * chunks * moe.num_experts,
             forwards * moe_passes)
  activation = act_bytes * rows * length * m.embed_dim
  if split:
    comm.add("all-gather", {"tensor"}, t * bucket, (forwards + 1 + w_resends) * moe_passes)
    comm.add("all-gather", {"tensor"}, 4 * t * n * capacity, forwards * moe_passes)
    comm.add("reduce-scatter", {"tensor"}, t * bucket, (forwards + 1) * moe_passes)
    if not sequence_parallel:
      comm.add("all-gather", {"tensor"}, activation, (forwards + 1) * moe_passes)
    elif split == "batch":  # from Megatron-SP's split of the length and back, by all-to-alls
      # the input in each forward, the output, and their gradients (W's once more)
      comm.add("all-to-all", {"tensor"}, activation / t,
               (forwards + 3 + w_resends) * moe_passes)
      routing = 4 * moe.experts_per_token * rows * length / t  # int32 experts, float32 weights
      comm.add("all-to-all", {"tensor"}, routing, (2 * forwards + 1) * moe_passes)
  else:
    comm.add("all-reduce", {"tensor"}, bucket, (forwards + 1) * moe_passes)
    comm.add("all-reduce", {"tensor"}, activation, moe_passes)


def stage_layers(cfg) -> tuple[int, int]:
  """In layers, what a pipeline step waits for on one stage and what each
  chunk holds: the executor runs the stages in lock step, and in a tick they
  all run a chunk of the same round v (chunks v*P to v*P + P - 1), so a step
  waits, round by round, for the stage with the most layers (an MoE model's
  leading dense layers count on stage 0); every chunk stores max(counts)
  layer slots (`stages.StageLayout`). The even split, and no pipeline, as
  ever: the model's layers over the stages, and over their chunks."""
  m, layout = cfg.model, stage_layout(cfg)
  if layout.even_split:
    return (m.num_layers // layout.num_stages,
            m.num_layers // (layout.num_stages * layout.num_chunks))
  return int(chunk_layers(cfg).max(axis=1).sum()), layout.slots


def dense_layers(cfg) -> int:
  """An MoE model's leading dense layers (`moe.first_dense_layers`), which
  run before the stacked ones, on a pipeline's first chunk; 0 for a dense
  model."""
  moe = cfg.model.moe
  return moe.first_dense_layers if moe.num_experts else 0


def chunk_layers(cfg, per_layer: float = 1) -> np.ndarray:
  """[V, P] the work of chunk v of stage s in a step at `per_layer` a layer
  (1: in layers): its stacked layers (`stage_layout`), and on the first
  chunk also the `dense_layers`."""
  work = stage_layout(cfg).counts_VxP() * per_layer
  work[0, 0] += dense_layers(cfg) * per_layer
  return work


def _gathers(names, cfg, in_ticks: bool = False) -> float:
  """How often a step gathers a weight split over batch axes (what XLA does):
  a stacked layer weight per layer and microbatch, forward and backward and
  again when recomputed; an embedding used only for lookups once (the backward
  of a lookup does not read the table); any other weight forward and backward,
  or once with accumulation (the gather is hoisted out of the microbatch loop).
  `in_ticks`: split over `fsdp` inside a pipeline, where the pieces run tick by
  tick and gather again each time (a profiled step: tests/test_plan.py): a
  layer weight in each microbatch's F and B, the embedding in every F of
  every stage (a select, not a conditional), the head's in the last stage's
  F and B (per device on average, as the other counts are)."""
  accum, lookup_only = cfg.grad_accum_steps, names == (r.VOCAB, r.EMBED) and not (
      cfg.model.tie_embeddings)
  p = cfg.pipeline
  if names[0] == r.LAYERS:
    return ((3 if cfg.remat == "full" else 2) * accum * cfg.model.num_layers
            * (p.microbatches if in_ticks else 1))
  if in_ticks:
    head = 2 * accum * p.microbatches / cfg.mesh.pipeline
    if names == (r.VOCAB, r.EMBED):
      return accum * p.microbatches * p.virtual_stages + (0 if lookup_only else head)
    return head
  return 1 if lookup_only or accum > 1 else 2


def llama_loss(spec):
  """The train step's loss of meshtrain's Llama, `loss(params, batch)` (the
  model state, if any, as it starts), its multi-token prediction included."""
  def loss_fn(params, batch):
    model = merged(spec, params, spec.init_model_state())
    return model_loss(model, with_loss_weights(batch, model.cfg.mtp_layers))[0]
  return loss_fn


def traced_model(cfg, layers: int, remat: str):
  """The model of `cfg` cut to `layers` layers, all alike (an MoE model's
  leading dense layers are counted as routed ones), to trace what it saves
  (its kernels are the slots')."""
  model_cfg = model_config(cfg)
  return dataclasses.replace(model_cfg, num_layers=layers, remat=remat,
                             moe=dataclasses.replace(model_cfg.moe, first_dense_layers=0))


def traced_execution(cfg, mesh) -> Execution:
  """The execution a plan traces the model's residuals with: the run's on
  `mesh`'s devices, with XLA's attention (cuDNN's traces only where cuDNN
  runs; `residual_bytes` drops the scores that flash attention never stores)."""
  return dataclasses.replace(execution_for(cfg, run_device(mesh)), attention="xla")


def residual_bytes(cfg, mesh, rules, *, layers: int, rows: int, remat: str,
                   on_host: bool = False) -> int:
  """Per-device bytes the Llama with `layers` layers saves on `rows` sequences
  in device memory (`on_host`: in host memory, as `remat="offload"` does)."""
  model_cfg = traced_model(cfg, layers, remat)
  # cuDNN's flash attention traces only where cuDNN runs: trace XLA's and drop
  # the [.., length, length] scores, which flash attention never stores.
  flash = attention_kernel(cfg, run_device(mesh)) == "cudnn" and sizes(mesh)["sequence"] == 1
  spec = llama_spec(model_cfg, slots(cfg, mesh, traced_execution(cfg, mesh)))
  batch = {k: jax.ShapeDtypeStruct((rows, cfg.seq_len), jnp.int32) for k in ("inputs", "targets")}
  saved = residuals.saved_residuals(llama_loss(spec), spec.abstract_params, spec.names, batch,
                                    mesh, rules)
  return sum(x.device_bytes for x in saved if x.on_host == on_host
             and not (flash and attention_scores(x.shape, cfg, rows)))


def attention_scores(shape: tuple[int, ...], cfg, rows: int) -> bool:
  """Whether a residual of `shape`, traced on `rows` sequences, is the
  attention's scores (which a flash kernel never keeps): [rows, heads,
  length, length], [rows, kv heads, group, length, length], either stacked
  over the layers, and not a [rows, length, embed] activation, stacked or
  not, of a model whose width equals its length (the 1B preset's 2,048,
  Mixtral's 4,096, the 70B's 8,192). Told apart by where the rows are: the
  activation's just before its last two dimensions, after a layer count
  other than `rows` where stacked (a head count may equal the rows)."""
  if tuple(shape[-2:]) != (cfg.seq_len, cfg.seq_len):
    return False
  activation = (cfg.model.embed_dim == cfg.seq_len and shape[-3] == rows
                and (len(shape) == 3 or len(shape) == 4 and shape[0] != rows))
  return not activation


def pipeline_slots(cfg, stages: int, microbatches: int, virtual_stages: int) -> dict[str, int]:
  """What one pipeline stage holds at its peak, in microbatch-chunks
  (`meshtrain.parallel.pipeline.runtime`; every stage allocates the largest
  stage's buffers), by buffer (`costs.SLOT_BUFFERS`): chunk inputs and input
  gradients waiting in their receive slots (`inputs`); the layers' F stash
  (`res`) and B's cut for W (`cut`); the head's and loss's (`head_res`,
  `head_cut`), which only the last chunk keeps."""
  counts = costs.table_counts(cfg.pipeline.schedule, stages, microbatches, virtual_stages)
  return {name: round(n) for name, n in zip(costs.SLOT_BUFFERS, counts.slots)}


def split_bytes(cfg, mesh, rules, rows: int) -> dict[str, int]:
  """Per-device bytes in device memory that a pipeline's split backward keeps
  of one layer for one microbatch of `rows` sequences (`split_values`)."""
  spec = llama_spec(traced_model(cfg, 1, cfg.remat), slots(cfg, mesh, traced_execution(cfg, mesh)))
  return {name: sum(v.device_bytes for v in values if not v.on_host)
          for name, values in split_values(spec, cfg, rows, mesh, rules).items()}


def split_values(spec, cfg, rows: int, mesh, rules) -> dict[str, list[residuals.Residual]]:
  """What a pipeline's split backward (`split.split_vjp`) keeps of one layer
  for one microbatch of `rows` sequences, each value with its layout: F's
  stash (`res`) and the cut B leaves for W (`cut`: the weight matmuls' inputs
  and output gradients). Traced from the layer the executor runs
  (`pipelined.model_pieces`) for `spec`'s model under `cfg.remat`, laid out
  by the rules."""
  layer_fn, names = pipelined.model_pieces(spec, cfg.remat)["layer_fn"], spec.names
  params, state = spec.abstract_params, jax.eval_shape(spec.init_model_state) or {}
  one = lambda tree: jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), tree)  # noqa: E731
  is_names = lambda n: isinstance(n, tuple)  # noqa: E731
  layer_p = {"params": one(params["layers"]), "state": one(state.get("layers", {}))}
  layer_names = {"params": jax.tree.map(lambda n: n[1:], names["layers"], is_leaf=is_names),
                 "state": jax.tree.map(lambda a: (None,) * a.ndim, layer_p["state"])}
  x = jax.ShapeDtypeStruct((rows, cfg.seq_len, cfg.model.embed_dim), jnp.dtype(cfg.compute_dtype))
  batch = {k: jax.ShapeDtypeStruct((rows, cfg.seq_len), jnp.int32) for k in ("inputs", "targets")}
  aux = {k: v for k, v in jax.eval_shape(with_loss_weights, batch).items() if k != "inputs"}
  aux_names = jax.tree.map(lambda a: (r.BATCH, r.LENGTH) + (None,) * (a.ndim - 2), aux)
  stashed = {}

  def stash_and_cut(p, x, aux):
    split = split_vjp(layer_fn, p, x, aux)
    y, stash, _ = split.forward(p, x, aux)
    stashed["count"] = len(stash)
    return stash, split.backward_input(p, aux, stash, y)[1]  # y: a gradient laid out as it
  leaves = jax.tree.leaves([layer_names, (r.BATCH, r.RES_LENGTH, r.ACT_EMBED), aux_names],
                           is_leaf=is_names)
  values = residuals.output_layouts(stash_and_cut, (layer_p, x, aux), leaves, mesh, rules)
  return {"res": values[:stashed["count"]], "cut": values[stashed["count"]:]}


def layer_and_head_residuals(cfg, mesh, rules, rows: int, remat: str,
                             on_host: bool = False) -> tuple[int, int]:
  """Per-device bytes one layer saves on `rows` sequences, and what the
  embedding, head and loss save (in device memory, or `on_host`): residuals
  grow linearly with depth (the layers' scan stacks them), so two traces
  give both."""
  one, two = (residual_bytes(cfg, mesh, rules, layers=n, rows=rows, remat=remat, on_host=on_host)
              for n in (1, 2))
  return two - one, 2 * one - two


def _microbatch_rows(cfg, mesh) -> int:
  """Sequences (over all devices) that one forward and backward runs on."""
  rows = cfg.global_batch // cfg.grad_accum_steps
  return rows // cfg.pipeline.microbatches if sizes(mesh)["pipeline"] > 1 else rows


def activation_bytes(cfg, mesh, rules: r.ShardingRules, on_host: bool = False) -> int:
  """Peak bytes per device of the residuals the model saves for its backward
  (`meshtrain.planner.residuals`) in device memory, or `on_host` (those
  `remat="offload"` moves there). A pipeline stage holds `pipeline_slots` of
  a chunk's inputs, of its layers' residuals and of the head's, for one
  microbatch each.
  """
  m, stages = cfg.model, sizes(mesh)["pipeline"]
  rows = _microbatch_rows(cfg, mesh)
  p = cfg.pipeline
  held = pipeline_slots(cfg, stages, p.microbatches, p.virtual_stages) if stages > 1 else {}
  if stages == 1 or on_host:  # offloaded residuals wait in F's stash
    per_layer, head = layer_and_head_residuals(cfg, mesh, rules, rows, cfg.remat, on_host)
    return (held.get("res", 1) * stage_layers(cfg)[1] * per_layer
            + held.get("head_res", 1) * head)
  per_device_rows = rows // prod([a for a in BATCH_AXES if sizes(mesh)[a] > 1], mesh)
  length = cfg.seq_len // (sizes(mesh)["tensor"] if _sequence_parallel(rules, mesh) else 1)
  inputs = (held["inputs"] * per_device_rows * length * m.embed_dim
            * jnp.dtype(cfg.compute_dtype).itemsize)
  per_microbatch = split_bytes(cfg, mesh, rules, rows)
  # The head's and loss's: what the whole model keeps for them, in each of
  # their slots (their backward in B, the prediction modules' included,
  # holds about that beside the stash: tests/test_mtp.py).
  head = layer_and_head_residuals(cfg, mesh, rules, rows, cfg.remat)[1]
  return (inputs + stage_layers(cfg)[1] * (held["res"] * per_microbatch["res"]
                                           + held["cut"] * per_microbatch["cut"])
          + (held["head_res"] + held["head_cut"]) * head)


def backward_bytes(cfg, mesh, rules: r.ShardingRules) -> int:
  """What the backward holds at its peak beyond the saved residuals. One
  layer's backward: its forward's intermediates (recomputed under `remat`)
  and their cotangents, against the compiled step (bench/plan_memory.py)
  about two layers' residuals without recomputation, whatever the policy.
  Without a pipeline the head's backward runs first, beside the logits in
  the compute dtype (`logits_bytes`), and the head's residuals are freed
  before the first layer's backward starts (read from the GPU program,
  docs/gpu_program.md): the peak is the larger of the two. A pipeline's
  stage keeps the head's stash while other microbatches' layers run."""
  rows = _microbatch_rows(cfg, mesh)
  layer = 2 * layer_and_head_residuals(cfg, mesh, rules, rows, "none")[0]
  if sizes(mesh)["pipeline"] > 1:
    return layer
  head = layer_and_head_residuals(cfg, mesh, rules, rows, cfg.remat)[1]
  return max(logits_bytes(cfg, mesh, rules, rows), layer - head)


def logits_bytes(cfg, mesh, rules: r.ShardingRules, rows: int) -> int:
  """Per-device bytes of the head's logits on `rows` sequences, in the
  compute dtype, split as the rules split [batch, length, vocabulary]."""
  spec = r.logical_to_spec((r.BATCH, r.LENGTH, r.ACT_VOCAB), rules.params)
  axis_size = sizes(mesh)
  split = [prod([a for a in ((p,) if isinstance(p, str) else p or ()) if axis_size[a] > 1], mesh)
           for p in spec]
  shape = (rows, cfg.seq_len, cfg.model.vocab_size)
  return math.prod(-(-n // k) for n, k in zip(shape, split)) * jnp.dtype(cfg.compute_dtype).itemsize


def _device_bytes(abstract, shardings) -> int:
  return sum(math.prod(sharding.shard_shape(x.shape)) * x.dtype.itemsize
             for x, sharding in zip(jax.tree.leaves(abstract), jax.tree.leaves(shardings)))


def trainer_plan(trainer, batch: dict) -> dict:
  """Per-device memory of any model's train step (`Trainer.plan`): the state
  from its shardings, the working weights and float32 gradients in the
  compute layout, and the residuals the model saves for its backward on
  `batch` (arrays or ShapeDtypeStructs: only shapes are read)."""
  abstract_state = jax.eval_shape(trainer.init)
  working = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.dtype(trainer.param_dtype)),
                         trainer.spec.abstract_params)
  grads = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.float32),
                       trainer.spec.abstract_params)
  compute = trainer.param_shardings()
  batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), batch)
  saved = residuals.saved_residuals(trainer.loss_fn, trainer.spec.abstract_params,
                                    trainer.spec.names, batch, trainer.mesh.abstract_mesh,
                                    trainer.rules)
  memory = {"params": _device_bytes(abstract_state.params, trainer.shardings.params),
            "optimizer": _device_bytes(abstract_state.opt_state, trainer.shardings.opt_state),
            "grads": _device_bytes(grads, compute),
            "activations": sum(x.device_bytes for x in saved)}
  if trainer.param_dtype != "float32":
    memory["params"] += _device_bytes(working, compute)
  memory["total"] = sum(memory.values())
  return {"memory_bytes": memory, "residuals": [dataclasses.asdict(x) for x in saved]}


def compile_step(setup, compiler_options: dict | None = None) -> jax.stages.Compiled:
  """The real train step compiled for setup.mesh, from shapes alone (nothing
  allocated); `compiler_options`: XLA's options for this compile, over XLA_FLAGS'."""
  cfg = setup.cfg
  abstract_state = jax.tree.map(
      lambda leaf, sharding: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding),
      jax.eval_shape(setup.init_state), setup.shardings)
  batch = {key: jax.ShapeDtypeStruct((cfg.global_batch, cfg.seq_len), np.int32,
                                     sharding=setup.train_step.batch_sharding)
           for key in ("inputs", "targets")}
  return setup.train_step.lower(abstract_state, batch).compile(compiler_options)


def measured(setup) -> dict:
  """Memory and collectives of the compiled train step."""
  compiled = compile_step(setup)
  memory = hlo.memory_bytes(compiled)
  return {"memory_bytes": {"arguments": memory["arguments"], "temp": memory["temp"],
                           "total": memory["total"]},
          "collectives": [dataclasses.asdict(c) for c in hlo.collectives(compiled, setup.mesh)]}


def usable_memory(target: gpu_targets.Target) -> int:
  """The bytes of a device of `target` a step may use: what the cluster
  preset of its kind allows (`clusters.Cluster.usable_memory`), all of it
  for another description."""
  preset = clusters.PRESETS.get(target.name)
  return int(target.memory_bytes * (preset.usable_memory if preset else 1))


def measured_on_target(setup, target: gpu_targets.Target) -> dict:
  """The train step compiled for `target`'s GPUs (`setup` built on its
  devices): memory per device against the device's, the collectives with
  what XLA scheduled under them and the hosts they cross, the GEMM and
  attention kernels, and the compile time. A step may use `usable_memory`."""
  usable = usable_memory(target)
  start = time.perf_counter()
  compiled = compile_step(setup)
  seconds = time.perf_counter() - start
  memory = hlo.memory_bytes(compiled)
  scheduled = gpu_program.collectives(compiled, setup.mesh)
  fits = memory["total"] <= usable
  notes = []
  if _offloads(setup.cfg):
    notes.append("memory ignores config.offload: deviceless GPUs report no host memory, so "
                 "the program keeps everything on the device")
  if not fits:
    notes.append("over the device's memory XLA's scheduler orders the program to lower its "
                 "peak, not to overlap: a config that fits hides more than the shares above")
  return {"target": str(target), "device_kind": target.device_kind,
          "compile_time_s": round(seconds, 1),
          "memory_bytes": {"arguments": memory["arguments"], "temp": memory["temp"],
                           "total": memory["total"]},
          "device_memory_bytes": target.memory_bytes,
          "usable_memory_bytes": usable,
          "fits": fits,
          "collectives": gpu_program.summary(scheduled),
          "hidden_share": gpu_program.hidden_share(scheduled),
          "kernels": gpu_program.kernels(compiled),
          "notes": notes}


def _offloads(cfg) -> bool:
  return bool(cfg.offload.params or cfg.offload.optimizer or cfg.remat == "offload")


def plan(cfg, num_devices: int, compile_step: bool,
         target: gpu_targets.Target | None = None) -> dict:
  """The `meshtrain plan` report. Without `compile_step` no device is touched,
  so it works for any model on any number of devices. With a `target` the
  step is compiled for its GPUs (on this machine: `gpu_targets`), and every
  execution choice (attention kernel, grouped GEMM) is made for them."""
  run = resolve(cfg, gpu_targets.devices(target) if target
                else abstract_mesh(cfg.mesh, num_devices))
  cfg, mesh = run.cfg, run.mesh
  spec = llama_spec(run.model)
  report = {"devices": num_devices, "mesh": dict(mesh.shape), "zero_stage": cfg.zero_stage,
            "parameters": flops.total_params(spec.abstract_params),
            "active_parameters": int(flops.active_params(run.model, spec.abstract_params)),
            "analytic": analytic(cfg, spec, run.rules, mesh)}
  if target:
    report["measured"] = measured_on_target(setup_lib.assemble(run), target)
  elif compile_step:
    report["measured"] = measured(setup_lib.build(cfg))
  report["collectives"] = report["measured" if compile_step or target else
                                 "analytic"]["collectives"]
  if cfg.model.moe.num_experts and cfg.experts.dispatch == "ragged":
    report["notes"] = ["the experts' all-to-alls are ragged: their bytes are those balanced "
                       "routing sends; the real ones follow the routing"]
  return report


def _mib(value) -> str:
  return "-" if value is None else f"{value / 2**20:10.2f}"


def _count(value) -> str:
  return "-" if value is None else f"{value:g}"


def format_plan(report: dict) -> str:
  shape = " x ".join(f"{a}={s}" for a, s in report["mesh"].items() if s > 1) or "one device"
  zero = f", zero_stage {report['zero_stage']}" if report["mesh"]["data"] > 1 else ""
  active = report.get("active_parameters", report["parameters"])
  routed = f" ({active / 1e6:.2f}M active per token)" if active != report["parameters"] else ""
  lines = [f"{report['parameters'] / 1e6:.2f}M parameters{routed} on {report['devices']} devices, "
           f"mesh {shape}{zero}", "", "memory per device (MiB)        analytic"]
  for key, value in report["analytic"]["memory_bytes"].items():
    lines.append(f"  {key:<26}{_mib(value)}")
  if "measured" in report:
    lines.append("measured (compiled step)")
    for key, value in report["measured"]["memory_bytes"].items():
      lines.append(f"  {key:<26}{_mib(value)}")
  lines += ["", "collectives per step           count   analytic MiB   measured count   measured MiB"]
  merged = collections.defaultdict(lambda: [None, None, None, None])
  for i, side in enumerate(("analytic", "measured")):
    for c in report.get(side, {}).get("collectives", []):
      row = merged[(c["kind"], c["axis"])]
      row[2 * i] = (row[2 * i] or 0) + c["count"]
      row[2 * i + 1] = (row[2 * i + 1] or 0) + c["bytes"]
  for (kind, axis), (count, nbytes, m_count, m_bytes) in sorted(merged.items()):
    lines.append(f"  {kind + ' ' + axis:<26}{_count(count):>9}   {_mib(nbytes)}   "
                 f"{_count(m_count):>14}   {_mib(m_bytes)}")
  if "measured" in report and report["mesh"]["pipeline"] > 1:
    lines.append("  (measured counts are static: every branch of the pipeline's tick as if it "
                 "ran; bench/strategies.py profiles a real step)")
  lines += [f"  ({note})" for note in report.get("notes", [])]
  if "target" in report.get("measured", {}):
    lines += _format_target(report["measured"])
  return "\n".join(lines)


def _format_target(measured: dict) -> list[str]:
  """The GPU program's own figures: memory against the device's, what runs
  under each kind of collective, the kernels."""
  total, usable = measured["memory_bytes"]["total"], measured["usable_memory_bytes"]
  lines = ["", f"GPU program for {measured['target']} ({measured['device_kind']}), compiled here "
           f"in {measured['compile_time_s']:g} s:",
           f"  per device {total / 2**30:.2f} GiB of the {usable / 2**30:.2f} GiB usable: "
           f"{'fits' if measured['fits'] else 'does not fit'}",
           "  collectives               MiB   hidden under matmuls   across hosts   async"]
  for c in measured["collectives"]:
    hidden = c["hidden_bytes"] / c["bytes"] if c["bytes"] else 0
    across = c["cross_host_bytes"] / c["bytes"] if c["bytes"] else 0
    lines.append(f"  {c['kind'] + ' ' + c['axis']:<24}{_mib(c['bytes'])}   {hidden:>20.0%}   "
                 f"{across:>12.0%}   {'yes' if c['asynchronous'] else 'no':>5}")
  if measured["hidden_share"] is not None:
    lines.append(f"  {measured['hidden_share']:.0%} of the collective bytes have matmuls "
                 "scheduled under them")
  lines.append("  kernels (not autotuned without a GPU): " + (", ".join(
      f"{k['kernel']} {k['operands']} x{k['count']:g}" for k in measured["kernels"]) or "none"))
  lines += [f"  ({note})" for note in measured["notes"]]
  return lines
