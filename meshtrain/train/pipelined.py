"""The Llama as a pipeline: embedding on stage 0, blocks in chunks on every
stage, final norm + head + loss on the last stage, run by one schedule table
through the shard_map executor (`meshtrain.parallel.pipeline.runtime`).

Why there: the embedding lookup needs only tokens, which every stage has, so
stage 0 starts at once; the head's matmul and the loss are the largest
activations ([batch, length, vocab] logits), and on the last stage they never
cross a stage boundary. Both are replicated over `pipeline` (every stage holds
them, only one computes); their gradients are summed over `pipeline` once per
step. Tied embeddings, or multi-token prediction (whose modules look up the
tokens ahead): the head's part of the executor's params holds the same
table, and its gradient (from the last stage) is added to the lookup's (from
stage 0). The modules run on the last stage, after the head, with their
routing counts and loss sums reported as the head's.
"""

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, PartitionSpec as P

from meshtrain import rules as r
from meshtrain.models.llama import (REMAT_POLICIES, after_layers, default_positions,
                                    predict_ahead, run_layers)
from meshtrain.parallel.pipeline import runtime, schedule as schedules
from meshtrain.parallel.pipeline.stages import StageLayout
from meshtrain.train.loss import cross_entropy, multi_token_loss, with_loss_weights
from meshtrain.train.microbatch import split_microbatches
from meshtrain.train.state import ModelSpec, merged

# (params, batch, model state) -> (mean loss, counts, float32 grads).
GradsFn = Callable[[dict, dict, object], tuple[jax.Array, dict, dict]]
LossFn = Callable[[dict, dict, object], jax.Array]


def model_pieces(spec: ModelSpec, remat: str) -> dict:
  """The Llama as the executor's embed_fn, layer_fn and loss_fn. One layer
  runs under the `remat` policy, which decides the residuals F stashes.
  The embedding's params are {"embed": ..., "dense": the leading dense
  layers' (an MoE model's `first_dense_layers`), or {}}; a layer's are
  {"params": ..., "state": its model state (the MoE bias), or {}}; the head's
  {"head": ..., "table": the embedding's where the head or the multi-token
  prediction modules use it, or {}, "mtp": the modules' {"params", "state"},
  or {}}."""
  model = merged(spec, spec.abstract_params, jax.eval_shape(spec.init_model_state))
  cfg = model.cfg
  embed_def, layers_def, head_def = (nnx.graphdef(m) for m in (model.embed, model.layers, model.head))
  dense_def = nnx.graphdef(model.dense_layers) if model.dense_layers is not None else None
  mtp_def = nnx.graphdef(model.mtp) if cfg.mtp_layers else None

  def positions_of(x_BxLxD, aux):
    segment_ids_BxL = aux.get("segment_ids")  # packed documents: attention inside each one
    return aux.get("positions", default_positions(x_BxLxD, segment_ids_BxL)), segment_ids_BxL

  def embed_fn(p, tokens_BxL, aux):
    x_BxLxD = nnx.merge(embed_def, p["embed"])(tokens_BxL)
    if dense_def is None:
      return x_BxLxD
    positions_BxL, segment_ids_BxL = positions_of(x_BxLxD, aux)
    return run_layers(nnx.merge(dense_def, p["dense"]), x_BxLxD, positions_BxL, remat,
                      segment_ids_BxL)[0]

  def layer_fn(p, x_BxLxD, aux):
    positions_BxL, segment_ids_BxL = positions_of(x_BxLxD, aux)

    def block(p, x):
      y, stats = nnx.merge(layers_def, p["params"], *([p["state"]] if p["state"] else []))\
          .forward(x, positions_BxL, segment_ids_BxL)
      return y, stats if stats is not None else {}
    if remat != "none":
      block = jax.checkpoint(block, policy=REMAT_POLICIES[remat])
    return block(p, x_BxLxD)

  def loss_fn(p, x_BxLxD, aux):
    head = nnx.merge(head_def, p["head"])
    if "mtp_inputs" in aux:
      embed = nnx.merge(embed_def, p["table"])
      mtp = nnx.merge(mtp_def, p["mtp"]["params"], *([p["mtp"]["state"]] if p["mtp"]["state"]
                                                     else []))
      positions_BxL, segment_ids_BxL = positions_of(x_BxLxD, aux)
      logits_BxLxV, mtp_logits, stats = predict_ahead(embed, head, mtp, cfg, x_BxLxD,
                                                      aux["mtp_inputs"], positions_BxL,
                                                      segment_ids_BxL)
      loss, sums = multi_token_loss(logits_BxLxV, mtp_logits, aux, cfg.mtp_loss_coef,
                                    model.slots.token_sum)
      return loss, {**(stats or {}), **sums}
    table_VxD = nnx.merge(embed_def, p["table"]).table() if cfg.tie_embeddings else None
    logits_BxLxV = head(x_BxLxD, table_VxD)
    return cross_entropy(logits_BxLxV, aux["targets"], aux.get("loss_weights")), {}

  return dict(embed_fn=embed_fn, layer_fn=layer_fn, loss_fn=loss_fn)


def uses_table(spec: ModelSpec) -> bool:
  """Whether the head's piece holds the embedding table (tied, or multi-token prediction)."""
  return "mtp" in spec.abstract_params or "head_DxV" not in spec.abstract_params["head"]


def _weight_specs(spec: ModelSpec, rules: r.Rules) -> dict:
  """The PartitionSpecs of the executor's params (`model_pieces`) under `rules`,
  a layer's without its stacked axis; the model state is replicated."""
  def specs(names, lead=0):  # without `lead` leading dimensions
    return jax.tree.map(lambda n: P(*r.logical_to_spec(n, rules)[lead:]), names,
                        is_leaf=lambda x: isinstance(x, tuple))
  names = spec.names
  model_state = jax.eval_shape(spec.init_model_state) or {}
  return {"embed": {"embed": specs(names["embed"]), "dense": specs(names.get("dense_layers", {}))},
          "layers": {"params": specs(names["layers"], lead=1),
                     "state": jax.tree.map(lambda _: P(), model_state.get("layers", {}))},
          "head": {"head": specs(names["head"]),
                   "table": specs(names["embed"]) if uses_table(spec) else {},
                   "mtp": {"params": specs(names["mtp"]),
                           "state": jax.tree.map(lambda _: P(), model_state.get("mtp", {}))}
                   if "mtp" in names else {}}}


def _with_positions(batch: dict) -> dict:
  """Rotary positions made whole before `sequence` splits the length: each
  device then sees only its own tokens."""
  if "positions" in batch:
    return batch
  return {**batch, "positions": default_positions(batch["inputs"], batch.get("segment_ids"))}


def _executor(spec, pipeline_cfg, mesh, rules, remat, schedule, replicas=False, layout=None):
  """(params, batch, model state) -> (loss, counts, grads or None) of one
  pipelined batch, the layers' weights and gradients in `layout`'s slots, its
  counts per layer of the model; with
  `replicas`, local SGD's: params lead with a replica dimension over `data`,
  each replica trains on its rows, loss and grads come back per replica.
  `layout` None: the even split of the model's layers."""
  pieces, table = model_pieces(spec, remat), uses_table(spec)
  if layout is None:
    layout = StageLayout.even(len(jax.tree.leaves(spec.abstract_params["layers"])[0]),
                              mesh.shape["pipeline"], pipeline_cfg.virtual_stages)
  # `data` splits only the batch and `sequence` only the length: taken manual,
  # each device sums its own gradients and they are all-reduced once, after
  # the last tick.
  batch_axes = ("data",) if mesh.shape["data"] > 1 and not replicas else ()
  length_axis = "sequence" if mesh.shape["sequence"] > 1 else None
  inner_rules = r.without_axis(r.without_axis(rules.params, "data"), "sequence")
  weight_specs = _weight_specs(spec, inner_rules)

  def run(params, batch, model_state=None):
    if length_axis:
      batch = _with_positions(batch)
    microbatches = split_microbatches(with_loss_weights(batch), pipeline_cfg.microbatches)
    pieces_params = {
        "embed": {"embed": params["embed"], "dense": params.get("dense_layers", {})},
        "layers": {"params": params["layers"],
                   "state": (model_state or {}).get("layers", {})},
        "head": {"head": params["head"], "table": params["embed"] if table else {},
                 "mtp": {"params": params["mtp"], "state": (model_state or {}).get("mtp", {})}
                 if "mtp" in params else {}}}
    with nnx.logical_axis_rules(inner_rules):
      loss, grads, stats, head_stats = runtime.pipeline_loss_and_grads(
          schedule, mesh, **pieces, params=pieces_params, microbatches=microbatches,
          batch_axes=batch_axes, length_axis=length_axis,
          replica_axis="data" if replicas else None, layout=layout, weight_specs=weight_specs)
    stats = jax.tree.map(jax.vmap(layout.from_slots), stats) if replicas else layout.from_slots(
        stats)
    stats = after_layers(stats, head_stats, axis=1 if replicas else 0)
    if grads is None:
      return loss, stats, None
    embed_g = grads["embed"]["embed"]
    if table:  # one weight, two uses: the lookup's gradient plus the head's
      embed_g = jax.tree.map(jnp.add, embed_g, grads["head"]["table"])
    dense = {"dense_layers": grads["embed"]["dense"]} if "dense_layers" in params else {}
    mtp = {"mtp": grads["head"]["mtp"]["params"]} if "mtp" in params else {}
    return loss, stats, {"embed": embed_g, **dense, "layers": grads["layers"]["params"],
                         "head": grads["head"]["head"], **mtp}
  return run


def pipelined_value_and_grad(spec: ModelSpec, pipeline_cfg, mesh: Mesh, rules: r.ShardingRules,
                             remat: str, grad_accum_steps: int = 1, replicas: bool = False,
                             layout: StageLayout | None = None) -> GradsFn:
  """(params, batch, model state) -> (mean loss, counts, float32 grads), the
  layers' weights and gradients in `layout`'s slots (`parallelize.in_stage_slots`;
  None: the even split); `batch`
  split into `grad_accum_steps` parts run one after another (a larger batch
  at the memory of one), each through the pipeline in
  `pipeline_cfg.microbatches` microbatches. With `replicas`, of every local
  SGD replica at once ([R] losses, [R, ...] grads; see `_executor`)."""
  schedule = schedules.build(pipeline_cfg.schedule, mesh.shape["pipeline"],
                             pipeline_cfg.microbatches, pipeline_cfg.virtual_stages)
  run = _executor(spec, pipeline_cfg, mesh, rules, remat, schedule, replicas, layout)
  if grad_accum_steps == 1:
    return run

  def accumulated(params, batch, model_state=None):
    parts = split_microbatches(batch, grad_accum_steps)

    def body(total, part):
      return jax.tree.map(jnp.add, total, run(params, part, model_state)), None
    zeros = jax.eval_shape(lambda: run(params, jax.tree.map(lambda x: x[0], parts), model_state))
    (loss, stats, grads), _ = jax.lax.scan(
        body, jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), zeros), parts)
    return loss / grad_accum_steps, stats, jax.tree.map(lambda x: x / grad_accum_steps, grads)
  return accumulated


def pipelined_loss(spec: ModelSpec, pipeline_cfg, mesh: Mesh, rules: r.ShardingRules,
                   layout: StageLayout | None = None) -> LossFn:
  """(params, batch, model state) -> mean loss, forward only (evaluation on a pipeline
  mesh): GPipe's forward wave, nothing stashed for a backward. `batch` holds
  `inputs`, `targets` and optionally `segment_ids`, `positions` ([B, L]),
  split into `pipeline_cfg.microbatches` microbatches; call it traced under
  the mesh and `rules.params` like the train step."""
  schedule = schedules.forward_only(mesh.shape["pipeline"], pipeline_cfg.microbatches,
                                    pipeline_cfg.virtual_stages)
  run = _executor(spec, pipeline_cfg, mesh, rules, "none", schedule, layout=layout)
  return lambda params, batch, model_state=None: run(params, batch, model_state)[0]
