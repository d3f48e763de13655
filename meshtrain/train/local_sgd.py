"""Local SGD / DiLoCo over the `data` axis: the parameter server's GEO mode in SPMD.

Every `data` replica keeps its own float32 weights and inner optimizer state
(a leading replica dimension, split over `data`). An inner step is the usual
train step mapped over that dimension (`jax.vmap` with `spmd_axis_name="data"`),
so `fsdp` and `tensor` shard each replica exactly as they shard the model
without local SGD, and the compiled inner step holds no collective over `data`.
With `pipeline`, the pipeline computes every replica's gradients at once
(`data` manual in its shard_map, each device on its replica's weights and
rows) and only the update is mapped. Every `inner_steps` steps the sync
step all-reduces the replicas' parameter deltas once: their mean is the outer
gradient, which an outer optimizer (SGD, or Nesterov momentum as in DiLoCo,
Douillard et al. 2023) applies to the shared weights; every replica restarts
from them and keeps its inner optimizer state.
"""

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from meshtrain import rules as r
from meshtrain.errors import ConfigError
from meshtrain.train import xla_options
from meshtrain.train.state import ModelSpec, TrainState, state_shardings
from meshtrain.train.step import (Program, StepOptions, batch_sharding, build_program,
                                  train_step)

OUTER_OPTIMIZERS = ("sgd", "momentum", "nesterov")


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class OuterState:
  params: Any     # the shared float32 weights, as of the last sync
  opt_state: Any  # the outer optimizer's state (momentum)


def validate(cfg) -> None:
  local = cfg.local_sgd
  if local.inner_steps < 0:
    raise ConfigError("config.local_sgd.inner_steps", f"{local.inner_steps} must be >= 0 (0: off)")
  if not local.inner_steps:
    return
  if local.inner_steps > cfg.steps:
    raise ConfigError("config.local_sgd.inner_steps", f"{local.inner_steps} is more than "
                      f"config.steps = {cfg.steps}, so the replicas would never sync; use "
                      f"{cfg.steps} or fewer")
  if local.outer_optimizer not in OUTER_OPTIMIZERS:
    raise ConfigError("config.local_sgd.outer_optimizer", f"{local.outer_optimizer!r} is not one "
                      f"of {', '.join(map(repr, OUTER_OPTIMIZERS))}")
  for part in ("optimizer", "params"):
    if cfg.offload[part]:
      raise ConfigError(f"config.offload.{part}", "local SGD keeps its replicas' state on the "
                        "devices; set it to False")
  if cfg.zero_stage:
    raise ConfigError("config.zero_stage", "local SGD keeps a whole model per `data` replica; "
                      "use zero_stage 0 and shard inside each replica with config.mesh.fsdp")


def outer_optimizer(local_cfg) -> optax.GradientTransformation:
  """Applies the mean delta (old shared weights - replica weights) as a gradient:
  `sgd` plainly (at rate 1 it averages the replicas; with H = 1 and inner SGD
  it is data-parallel SGD), `momentum` (heavy ball) and `nesterov` (DiLoCo's)
  with `outer_momentum`."""
  name = local_cfg.outer_optimizer
  momentum = None if name == "sgd" else local_cfg.outer_momentum or None
  return optax.sgd(local_cfg.outer_learning_rate, momentum=momentum, nesterov=name == "nesterov")


def _stacked(sharding: NamedSharding) -> NamedSharding:
  """The layout of the same array with a leading replica dimension over `data`."""
  return NamedSharding(sharding.mesh, P("data", *sharding.spec))


def inner_rules(rules: r.ShardingRules) -> r.ShardingRules:
  """One replica's rules: the strategy's tables without `data`."""
  return r.ShardingRules(*(r.without_axis(table, "data")
                           for table in (rules.params, rules.grads, rules.optimizer)))


@dataclasses.dataclass(frozen=True)
class LocalProgram:
  """What the inner and sync steps read, resolved once."""
  replica_step: Program  # one replica's train step, mapped over `data`
  replicas: int
  rules: r.ShardingRules      # the strategy's (the pipeline's replica gradients trace under them)
  one: r.ShardingRules        # one replica's: the tables without `data`
  replica_params: Any         # one replica's parameter layout
  outer_optimizer: optax.GradientTransformation
  replica_grads_fn: Callable | None  # every replica's (loss, grads) at once, or None


def _computed(params, batch, model_state=None):
  """A replica's step whose batch is its already computed (loss, grads)."""
  return batch["loss"], {}, batch["grads"]


def inner_step(program: LocalProgram, state: TrainState, batch) -> tuple[TrainState, dict]:
  """Every replica's step on its rows, mapped over `data`: no collective over it."""
  def one_replica(params, opt_state, nonfinite_steps, batch):
    new, metrics = train_step(program.replica_step,
                              TrainState(state.step, params, opt_state, nonfinite_steps,
                                         model_state=state.model_state), batch)
    return new.params, new.opt_state, new.nonfinite_steps, metrics

  if program.replica_grads_fn:
    dtype = jnp.dtype(program.replica_step.options.param_dtype)
    with nnx.logical_axis_rules(program.rules.params):
      loss, _, grads = program.replica_grads_fn(
          jax.tree.map(lambda x: x.astype(dtype), state.params), batch, state.model_state)
    by_replica = {"loss": loss, "grads": grads}
  else:
    by_replica = jax.tree.map(lambda x: x.reshape(program.replicas, -1, *x.shape[1:]), batch)
  with nnx.logical_axis_rules(program.one.params):
    params, opt_state, nonfinite_steps, metrics = jax.vmap(one_replica, spmd_axis_name="data")(
        state.params, state.opt_state, state.nonfinite_steps, by_replica)
  return dataclasses.replace(state, step=state.step + 1, params=params, opt_state=opt_state,
                             nonfinite_steps=nonfinite_steps), metrics


def sync(program: LocalProgram, state: TrainState) -> TrainState:
  """The outer step: the replicas' mean delta (the one all-reduce over `data`)
  applied to the shared weights, from which every replica starts again."""
  shared = state.outer.params
  delta = jax.lax.with_sharding_constraint(
      jax.tree.map(lambda old, new: (old[None] - new).mean(0), shared, state.params),
      program.replica_params)
  updates, opt_state = program.outer_optimizer.update(delta, state.outer.opt_state, shared)
  shared = optax.apply_updates(shared, updates)
  params = jax.tree.map(lambda x: jnp.broadcast_to(x, (program.replicas, *x.shape)), shared)
  return dataclasses.replace(state, params=params, outer=OuterState(shared, opt_state))


def reduce_metrics(metrics: dict) -> dict:
  """The replicas' mean loss and gradient norm, their summed dropped steps."""
  return {key: value.sum() if key == "nonfinite_steps" else value.mean()
          for key, value in metrics.items()}


class LocalSGDStep:
  """`state, metrics = step(state, batch)`: an inner step, followed by the sync
  step after every `inner_steps`-th. Metrics are the replicas' mean loss and
  gradient norm and their summed count of dropped steps, reduced by a separate
  few-scalar program so the inner step itself talks to no other replica.

  A replica whose loss or gradients are not finite drops that update (counted
  in its `nonfinite_steps`); `nan_policy=stop` then stops the run when the
  loop next looks."""

  def __init__(self, local_cfg, spec: ModelSpec, loss_fn, optimizer: optax.GradientTransformation,
               mesh: Mesh, rules: r.ShardingRules, *, replica_grads_fn=None, schedule=None,
               **step_options):
    """`step_options` are `StepOptions`' (grad_accum_steps, param_dtype, grad_dtype).
    `replica_grads_fn(params, batch, model_state) -> ([R] losses, {}, [R, ...]
    grads)` computes every replica's gradients at once, each on its rows (the pipeline, whose
    shard_map a vmap over `data` cannot enter: the vmap would add the manual
    `data` to the model's sharding constraints inside)."""
    self.mesh, self.rules, self.inner_steps = mesh, rules, local_cfg.inner_steps
    one = inner_rules(rules)
    replica = state_shardings(spec, optimizer, mesh, one)  # one replica's layout
    outer = outer_optimizer(local_cfg)
    self.shardings = TrainState(
        step=replica.step, params=jax.tree.map(_stacked, replica.params),
        opt_state=jax.tree.map(_stacked, replica.opt_state),
        nonfinite_steps=NamedSharding(mesh, P("data")),
        outer=OuterState(replica.params, state_shardings(spec, outer, mesh, one).opt_state),
        model_state=replica.model_state)
    self._optimizer, self._spec = optimizer, spec
    options = StepOptions(nan_policy="skip", replicas=1, **step_options)
    replica_step = build_program(loss_fn, spec.names, optimizer, mesh, one, replica, options,
                                 schedule, _computed if replica_grads_fn else None)
    self.program = LocalProgram(replica_step, mesh.shape["data"], rules, one, replica.params,
                                outer, replica_grads_fn)
    self.batch_sharding = batch_sharding(mesh, rules)
    self._inner = jax.jit(functools.partial(inner_step, self.program),
                          in_shardings=(self.shardings, self.batch_sharding),
                          out_shardings=(self.shardings, None), donate_argnums=0,
                          compiler_options=xla_options.for_mesh(mesh))
    self._sync = jax.jit(functools.partial(sync, self.program), in_shardings=(self.shardings,),
                         out_shardings=self.shardings, donate_argnums=0,
                         compiler_options=xla_options.for_mesh(mesh))
    self._reduce = jax.jit(reduce_metrics)
    self._last = None  # (the step array we last returned, its value): no host sync per step

  def init_state(self) -> TrainState:
    """Every replica starts from the same weights, which are also the shared ones."""
    replicas, outer = self.program.replicas, self.program.outer_optimizer

    def create():
      params = self._spec.init()
      stack = lambda tree: jax.tree.map(lambda x: jnp.broadcast_to(x, (replicas, *x.shape)), tree)
      return TrainState(jnp.zeros((), jnp.int32), stack(params), stack(self._optimizer.init(params)),
                        jnp.zeros((replicas,), jnp.int32), OuterState(params, outer.init(params)),
                        model_state=self._spec.init_model_state())
    return jax.jit(create, out_shardings=self.shardings)()

  def _with_mesh(self, fn, *args):
    with jax.set_mesh(self.mesh):
      return fn(*args)

  def __call__(self, state: TrainState, batch):
    last_array, last_step = self._last or (None, None)
    step = last_step + 1 if state.step is last_array else int(state.step) + 1
    state, metrics = self._with_mesh(self._inner, state, batch)
    if step % self.inner_steps == 0:
      state = self._with_mesh(self._sync, state)
    self._last = (state.step, step)
    return state, self._reduce(metrics)

  def lower(self, state: TrainState, batch) -> jax.stages.Lowered:
    """The inner step."""
    return self._with_mesh(self._inner.lower, state, batch)

  def lower_sync(self, state: TrainState) -> jax.stages.Lowered:
    return self._with_mesh(self._sync.lower, state)


def plan(cfg, spec: ModelSpec, rules: r.ShardingRules, mesh) -> dict:
  """What local SGD changes in `meshtrain plan`'s analytic report, per device:
  the outer state it adds (float32 shared weights, and momentum when set) and
  its only traffic over `data`, the sync's float32 all-reduce of the deltas,
  once every `inner_steps` steps (per step: count and bytes / inner_steps)."""
  one = inner_rules(rules)
  shard_elements = sum(
      leaf.size / math.prod(mesh.shape[a] for a in jax.tree.leaves(tuple(r.logical_to_spec(n, one.optimizer))))
      for n, leaf in zip(jax.tree.leaves(spec.names, is_leaf=lambda x: isinstance(x, tuple)),
                         jax.tree.leaves(spec.abstract_params)))
  local, n = cfg.local_sgd, mesh.shape["data"]
  outer_bytes = 4 * shard_elements * (2 if local.outer_momentum else 1)
  sync_bytes = 2 * (n - 1) / n * 4 * shard_elements  # ring all-reduce
  return {"outer_state_bytes": int(outer_bytes),
          "sync": {"kind": "all-reduce", "axis": "data", "count": 1 / local.inner_steps,
                   "bytes": int(sync_bytes / local.inner_steps)}}
