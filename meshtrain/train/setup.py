"""From a config to everything a run needs: mesh, rules, model, optimizer, state layout and step."""

import dataclasses

import jax
import optax
from jax.sharding import Mesh

from meshtrain import rules as r
from meshtrain.data import packing as data_packing
from meshtrain.mesh import make_mesh
from meshtrain.train import local_sgd, mesh_checks, parallelize, precision
from meshtrain.train.optimizer import learning_rate_schedule, make_optimizer
from meshtrain.train.precision import initial_loss_scale
from meshtrain.train.loss import model_loss
from meshtrain.train.pipelined import pipelined_value_and_grad
from meshtrain.train.state import (ModelSpec, TrainState, in_memory, init_state, merged,
                                   state_shardings, with_memory_kind)
from meshtrain.train.step import LossFn, TrainStep



@dataclasses.dataclass(frozen=True)
class Setup:
  cfg: object
  mesh: Mesh
  rules: r.ShardingRules
  spec: ModelSpec
  optimizer: optax.GradientTransformation
  schedule: optax.Schedule
  shardings: TrainState
  train_step: TrainStep | local_sgd.LocalSGDStep
  loss_fn: LossFn  # (params, batch, model state) -> (mean loss, counts), as the step trains it

  def init_state(self) -> TrainState:
    if isinstance(self.train_step, local_sgd.LocalSGDStep):
      return self.train_step.init_state()
    return init_state(self.spec, self.optimizer, self.shardings, initial_loss_scale(self.cfg))

  def abstract_state(self) -> TrainState:
    """Shapes and dtypes of the state, for restoring into."""
    return jax.eval_shape(self.init_state)


def padded_vocab(cfg, tensor: int):
  """The config with `model.vocab_size` rounded up to a multiple of `tensor`
  (the mesh's) where the data's ids are fewer than the vocabulary (a prepared
  corpus, byte-level text): the extra rows are padding, never a target, and
  `vocab` splits evenly. A synthetic task's vocabulary is the task: as given."""
  if cfg.data.source not in ("tokens", "text") or not cfg.model.vocab_size % tensor:
    return cfg
  cfg = cfg.copy_and_resolve_references()
  cfg.model.vocab_size = -(-cfg.model.vocab_size // tensor) * tensor
  return cfg


def with_packing(cfg):
  """The config with `data.packing` "auto" resolved (`meshtrain.data.packing`):
  "segments" for a corpus with a loss mask, else "concat"."""
  resolved = data_packing(cfg.data)
  if resolved == cfg.data.packing:
    return cfg
  cfg = cfg.copy_and_resolve_references()
  cfg.data.packing = resolved
  return cfg


def sharding_rules(cfg, mesh) -> r.ShardingRules:
  return r.strategy_rules(mesh, cfg.zero_stage, tensor_sequence_parallel=cfg.tensor_sequence_parallel,
                          split_kv_heads=cfg.model.num_kv_heads % mesh.shape["tensor"] == 0,
                          expert_axes=parallelize.expert_axes(cfg))


def build(cfg, devices=None) -> Setup:
  cfg = with_packing(cfg)
  mesh = make_mesh(cfg.mesh, devices if devices is not None else jax.devices())
  mesh_checks.check(cfg, mesh)
  mesh_checks.check_machine(cfg, mesh)
  local_sgd.validate(cfg)
  precision.validate(cfg)
  rules = sharding_rules(cfg, mesh)
  spec = parallelize.model_spec(cfg, mesh)
  schedule = learning_rate_schedule(cfg.optimizer, cfg.steps)
  optimizer = make_optimizer(cfg.optimizer, cfg.steps)
  shardings = state_shardings(spec, optimizer, mesh, rules, initial_loss_scale(cfg))
  shardings = offloaded(shardings, cfg.offload)

  order = parallelize.batch_order(cfg)

  def loss_fn(params, batch, model_state):
    return model_loss(merged(spec, params, model_state), order(batch))

  grads_fn = (pipelined_value_and_grad(spec, cfg.pipeline, mesh, rules, cfg.remat,
                                       cfg.grad_accum_steps,
                                       replicas=bool(cfg.local_sgd.inner_steps),
                                       layout=parallelize.stage_layout(cfg))
              if mesh.shape["pipeline"] > 1 else None)
  if cfg.local_sgd.inner_steps:
    step = local_sgd.LocalSGDStep(cfg.local_sgd, spec, loss_fn, optimizer, mesh, rules,
                                  replica_grads_fn=grads_fn,
                                  grad_accum_steps=cfg.grad_accum_steps,
                                  param_dtype=cfg.param_dtype, grad_dtype=cfg.grad_dtype,
                                  mtp_depth=cfg.model.mtp_layers, schedule=schedule)
    return Setup(cfg, mesh, rules, spec, optimizer, schedule, step.shardings, step, loss_fn)
  step = TrainStep(loss_fn, spec.names, optimizer, mesh, rules, shardings,
                   grad_accum_steps=cfg.grad_accum_steps, param_dtype=cfg.param_dtype,
                   grad_dtype=cfg.grad_dtype, schedule=schedule, grads_fn=grads_fn,
                   update_model_state=spec.update_model_state, stat_metrics=spec.metrics,
                   nan_policy=cfg.nan_policy, loss_scale_period=cfg.loss_scale.period,
                   streamed="layers" if cfg.offload.params else None,
                   # the MoE balance counts the whole batch's tokens
                   replica_sums=not cfg.model.moe.num_experts,
                   mtp_depth=cfg.model.mtp_layers)
  return Setup(cfg, mesh, rules, spec, optimizer, schedule, shardings, step, loss_fn)


def offloaded(shardings: TrainState, offload_cfg) -> TrainState:
  """The state's layout with what `config.offload` names in pinned host memory:
  the master weights and optimizer state (`optimizer`), the layers' weights
  (`params`, streamed to the device layer by layer)."""
  shardings = in_memory(shardings, "pinned_host") if offload_cfg.optimizer else shardings
  if offload_cfg.params:
    layers = with_memory_kind(shardings.params["layers"], "pinned_host")
    shardings = dataclasses.replace(shardings, params={**shardings.params, "layers": layers})
  return shardings
