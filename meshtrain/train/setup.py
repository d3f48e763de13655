"""From a resolved run to what it trains with: model, optimizer, state layout and step."""

import dataclasses

import jax
import optax
from jax.sharding import Mesh

from meshtrain import rules as r
from meshtrain.train import local_sgd, parallelize
from meshtrain.train.run import Run, resolve
from meshtrain.train.optimizer import learning_rate_schedule, make_optimizer
from meshtrain.train.precision import initial_loss_scale
from meshtrain.train.loss import model_loss
from meshtrain.train.pipelined import pipelined_value_and_grad
from meshtrain.train.state import (ModelSpec, TrainState, in_memory, init_state, merged,
                                   state_shardings, with_memory_kind)
from meshtrain.train.step import LossFn, TrainStep


@dataclasses.dataclass(frozen=True)
class Setup:
  """A model built to train on one mesh: its spec, optimizer, state layout and
  step. `build` makes meshtrain's Llama of a resolved run (`run`, with every
  strategy of its config); `meshtrain.trainer.Trainer` wraps one for any model."""
  spec: ModelSpec
  optimizer: optax.GradientTransformation
  shardings: TrainState
  train_step: TrainStep | local_sgd.LocalSGDStep
  loss_fn: LossFn  # (params, batch, model state) -> (mean loss, counts), as the step trains it
  run: Run | None = None  # None for a model that is not meshtrain's own
  schedule: optax.Schedule | None = None  # the learning rate by step, where known

  @property
  def cfg(self):
    return self.run.cfg

  @property
  def mesh(self) -> Mesh:
    return self.train_step.mesh

  @property
  def rules(self) -> r.ShardingRules:
    return self.train_step.rules

  def init_state(self) -> TrainState:
    """Fresh weights and optimizer state, created in their shards."""
    if isinstance(self.train_step, local_sgd.LocalSGDStep):
      return self.train_step.init_state()
    return init_state(self.spec, self.optimizer, self.shardings,
                      initial_loss_scale(self.cfg) if self.run else None)

  def abstract_state(self) -> TrainState:
    """Shapes and dtypes of the state, for restoring into."""
    return jax.eval_shape(self.init_state)


def model_spec(run: Run) -> ModelSpec:
  """The run's Llama with its slots filled for the run's mesh, its layers'
  weights (and state) stored as the pipeline's stage layout holds them."""
  model_slots = parallelize.slots(run.cfg, run.mesh, run.execution)
  return parallelize.in_stage_slots(parallelize.llama_spec(run.model, model_slots, run.cfg.seed),
                                    run.layout)


def build(cfg, devices=None) -> Setup:
  """`cfg` resolved on `devices` (`meshtrain.train.run.resolve`) and assembled."""
  return assemble(resolve(cfg, devices))


def assemble(run: Run) -> Setup:
  """The model, optimizer, state layout and train step of `run` (on a mesh of devices)."""
  cfg, mesh, rules = run.cfg, run.mesh, run.rules
  spec = model_spec(run)
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
                                       layout=run.layout)
              if run.pipelined else None)
  if cfg.local_sgd.inner_steps:
    step = local_sgd.LocalSGDStep(cfg.local_sgd, spec, loss_fn, optimizer, mesh, rules,
                                  replica_grads_fn=grads_fn,
                                  grad_accum_steps=cfg.grad_accum_steps,
                                  param_dtype=cfg.param_dtype, grad_dtype=cfg.grad_dtype,
                                  mtp_depth=cfg.model.mtp_layers, schedule=schedule)
    return Setup(spec, optimizer, step.shardings, step, loss_fn, run, schedule)
  step = TrainStep(loss_fn, spec.names, optimizer, mesh, rules, shardings,
                   grad_accum_steps=cfg.grad_accum_steps, param_dtype=cfg.param_dtype,
                   grad_dtype=cfg.grad_dtype, schedule=schedule, grads_fn=grads_fn,
                   update_model_state=spec.update_model_state, stat_metrics=spec.metrics,
                   nan_policy=cfg.nan_policy, loss_scale_period=cfg.loss_scale.period,
                   streamed="layers" if cfg.offload.params else None,
                   # the MoE balance counts the whole batch's tokens
                   replica_sums=not cfg.model.moe.num_experts,
                   mtp_depth=cfg.model.mtp_layers)
  return Setup(spec, optimizer, shardings, step, loss_fn, run, schedule)


def offloaded(shardings: TrainState, offload_cfg) -> TrainState:
  """The state's layout with what `config.offload` names in pinned host memory:
  the master weights and optimizer state (`optimizer`), the layers' weights
  (`params`, streamed to the device layer by layer)."""
  shardings = in_memory(shardings, "pinned_host") if offload_cfg.optimizer else shardings
  if offload_cfg.params:
    layers = with_memory_kind(shardings.params["layers"], "pinned_host")
    shardings = dataclasses.replace(shardings, params={**shardings.params, "layers": layers})
  return shardings
