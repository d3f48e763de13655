"""The train step: working-copy cast, gradients (accumulated), optimizer update.

Precision: the state holds float32 master weights; forward and backward run on
a copy cast to `param_dtype` and laid out by the `params` rules (under ZeRO-1/2
that layout change is the parameter all-gather), activations in
`compute_dtype`, logits and loss in float32. Gradients are accumulated in
`grad_dtype` (float32 by default) in the layout of the `grads` rules.

`train_step(program, state, batch)` is a pure function of a frozen `Program`
(what to differentiate, how to update, where each part of the state lies);
`TrainStep` builds the program and jits it.

Health: a step whose loss, gradient norm, new weights or new optimizer state
are not finite changes nothing but `nonfinite_steps`. Under
`nan_policy="skip"` training goes on (`step` counts the dropped step); under
"stop" the state stays frozen at the last good step from then on, so the loop
can save it when it next looks. With a `state.loss_scale` (float16) the loss
is scaled before the backward pass and the gradients unscaled after
(`meshtrain.train.precision`); a step whose gradients overflow while its loss
is finite is skipped, counted in `loss_scale.overflow_steps` and not as
non-finite, and the scale halves.
"""

import contextlib
import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from meshtrain import rules as r
from meshtrain.train import precision, xla_options
from meshtrain.train.loss import with_loss_weights
from meshtrain.train.microbatch import split_microbatches
from meshtrain.train.state import TrainState, in_memory, is_offloaded

Batch = dict[str, jax.Array]
# (params, batch, model state) -> (mean loss, counts the model reports: sums
# over the batch's tokens, e.g. the MoE routing's; {} for most models)
LossFn = Callable[[dict, Batch, Any], tuple[jax.Array, dict]]
# (params, batch, model state, loss scale=None) -> (loss, counts, gradients in grad_dtype)
GradsFn = Callable[..., tuple[jax.Array, dict, dict]]
# Batch leaves are [batch, length, ...]: rows split over data x fsdp, tokens over sequence.
BATCH_NAMES = (r.BATCH, r.LENGTH)


def batch_sharding(mesh: Mesh, rules: r.ShardingRules) -> NamedSharding:
  """The layout of every batch leaf (trailing unsharded dimensions dropped, so
  that it fits leaves of any rank)."""
  parts = list(r.logical_to_spec(BATCH_NAMES, rules.params))
  while parts and parts[-1] is None:
    parts.pop()
  return NamedSharding(mesh, P(*parts))


def _cast(tree, dtype):
  return jax.tree.map(lambda x: x.astype(dtype), tree)


def _all_finite(tree) -> jax.Array:
  return jnp.all(jnp.stack([jnp.isfinite(x).all() for x in jax.tree.leaves(tree)]))


# Gradients.

def value_and_grad(loss_fn: LossFn, grad_dtype: str, params, batch: Batch, model_state=None,
                   scale=None):
  """The mean loss, its counts and its gradients in `grad_dtype`; with `scale`
  the backward pass starts from it, not 1 (float16 loss scaling)."""
  def loss(p):
    return loss_fn(p, batch, model_state)
  if scale is None:
    (value, stats), grads = jax.value_and_grad(loss, has_aux=True)(params)
  else:
    value, backward, stats = jax.vjp(loss, params, has_aux=True)
    grads, = backward(scale.astype(value.dtype))
  return value, stats, _cast(grads, grad_dtype)


def replica_value_and_grad(grads_fn: GradsFn, replicas: int, rules: r.ShardingRules,
                           params, batch: Batch, model_state=None, scale=None):
  """Per-replica losses [data], counts and gradients [data, ...], not yet
  summed: each `data` replica's rows through `grads_fn` (a vmap over `data`)."""
  def by_replica(x):
    return x.reshape(replicas, x.shape[0] // replicas, *x.shape[1:])
  with nnx.logical_axis_rules(r.without_axis(rules.params, "data")):
    return jax.vmap(grads_fn, in_axes=(None, 0, None, None), spmd_axis_name="data")(
        params, jax.tree.map(by_replica, batch), model_state, scale)


def accumulated(grads_fn: GradsFn, count: int, grad_specs, grad_dtype: str, replicas: int,
                params, batch: Batch, model_state=None, scale=None):
  """Mean loss and gradient over `count` microbatches, summed in `grad_dtype`
  in the `grad_specs` layout, and the sum of their counts. With `replicas` >
  1, `grads_fn` returns each replica's own sums (`replica_value_and_grad`),
  reduced once at the end."""
  lead = (replicas,) if replicas > 1 else ()
  specs = jax.tree.map(lambda s: P("data", *s), grad_specs) if lead else grad_specs
  microbatches = split_microbatches(batch, count)

  def body(carry, microbatch):
    loss, stats, grads = grads_fn(params, microbatch, model_state, scale)
    grads = jax.lax.with_sharding_constraint(grads, specs)
    return jax.tree.map(jnp.add, carry, (loss, stats, grads)), None

  zeros = jax.lax.with_sharding_constraint(
      jax.tree.map(lambda p: jnp.zeros(lead + p.shape, grad_dtype), params), specs)
  no_stats = jax.tree.map(jnp.zeros_like, jax.eval_shape(
      lambda: grads_fn(params, _take_first(microbatches), model_state, scale)[1]))
  (loss, stats, grads), _ = jax.lax.scan(
      body, (jnp.zeros(lead, jnp.float32), no_stats, zeros), microbatches)
  total = lambda x: x.sum(0) if lead else x  # noqa: E731
  mean = lambda x: total(x) / (count * max(replicas, 1))  # noqa: E731
  return mean(loss), jax.tree.map(total, stats), jax.tree.map(mean, grads)


def _take_first(microbatches: Batch) -> Batch:
  return jax.tree.map(lambda x: x[0], microbatches)


# The step.

@dataclasses.dataclass(frozen=True)
class StepOptions:
  """How a step trains, apart from the model, the optimizer and the layout."""
  grad_accum_steps: int = 1
  param_dtype: str = "float32"
  grad_dtype: str = "float32"
  nan_policy: str = "stop"     # stop | skip (see the module docstring)
  loss_scale_period: int = 2000
  replicas: int | None = None  # data-parallel degree; default the `data` axis, 1 where a caller
                               # maps the step over `data` itself (local SGD)
  streamed: str | None = None  # a params subtree that stays on the host through forward and
                               # backward (`config.offload.params`); it comes in per layer
  replica_sums: bool = True    # with accumulation, each `data` replica may sum its own
                               # gradients (off where the loss needs the whole batch's counts)
  mtp_depth: int = 0           # the model's multi-token prediction modules (loss.mtp_batch)


@dataclasses.dataclass(frozen=True)
class Program:
  """What `train_step` reads, resolved once."""
  grads_fn: GradsFn
  optimizer: optax.GradientTransformation
  update_model_state: Callable[[Any, dict], Any] | None  # after a healthy step, from its counts
  stat_metrics: Callable[[dict], dict] | None            # the counts as logged metrics
  schedule: optax.Schedule | None
  options: StepOptions
  param_shardings: Any   # the working copy's layout (the `params` rules)
  shardings: TrainState  # the state's layout between steps
  on_device: TrainState  # the same with everything in device memory (the update's)
  compute: TrainState    # where forward and backward find the state: on the device, but
                         # the streamed weights
  offloaded: bool        # whether any of the state lies in host memory between steps


def working_weights(program: Program, params):
  """The forward's weights: cast to `param_dtype` and laid out by the `params`
  rules; streamed weights stay where they are (cast per layer on the device)."""
  dtype, streamed = jnp.dtype(program.options.param_dtype), program.options.streamed
  if streamed is None:
    return jax.lax.with_sharding_constraint(_cast(params, dtype), program.param_shardings)
  rest = {k: v for k, v in params.items() if k != streamed}
  working = jax.lax.with_sharding_constraint(
      _cast(rest, dtype), {k: program.param_shardings[k] for k in rest})
  return {**working, streamed: params[streamed]}


def gradients(program: Program, state: TrainState, batch: Batch):
  """Loss, counts and gradients of the batch at the state's weights,
  unscaled, the gradients in the optimizer's layout on the device."""
  scale = None if state.loss_scale is None else state.loss_scale.scale
  loss, stats, grads = program.grads_fn(working_weights(program, state.params), batch,
                                        state.model_state, scale)
  if scale is not None:
    grads = jax.tree.map(lambda g: g / scale, grads)
  if program.options.streamed:  # the streamed gradients came back to the host
    grads = jax.device_put(grads, jax.memory.Space.Device)
  # Gradients meet the optimizer in its layout: an all-reduce for replicated
  # state, a reduce-scatter for sharded state (ZeRO, FSDP).
  return loss, stats, jax.lax.with_sharding_constraint(grads, program.on_device.params)


def _update(optimizer, params, opt_state, grads):
  updates, opt_state = optimizer.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state


def _keep(params, opt_state, grads):
  return params, opt_state


def apply_update(program: Program, state: TrainState, grads, healthy: jax.Array):
  """The new weights and optimizer state where `healthy`, else the old ones.
  A branch, not a select of new and old state: a select still needs each old
  optimizer moment when the new one is written over it (the donated buffer),
  so XLA copied every moment, twice the weights' bytes, each step."""
  update = functools.partial(_update, program.optimizer)
  return jax.lax.cond(healthy, update, _keep, state.params, state.opt_state, grads)


def train_step(program: Program, state: TrainState, batch: Batch
               ) -> tuple[TrainState, dict[str, jax.Array]]:
  """One step: `(state, batch) -> (new state, metrics)`."""
  options = program.options
  if program.offloaded:  # offloaded weights come to the device for the forward
    state = dataclasses.replace(state, params=jax.device_put(state.params,
                                                             program.compute.params))
  # Weighed once, whole: each microbatch's and replica's share of the mean loss.
  loss, stats, grads = gradients(program, state, with_loss_weights(batch, options.mtp_depth))
  if program.offloaded:
    # The optimizer state comes for the update alone: the barrier ties its
    # placement to the gradients, so the forward and backward run without it.
    grads, opt_state = jax.lax.optimization_barrier((grads, state.opt_state))
    state = dataclasses.replace(state, opt_state=jax.device_put(opt_state,
                                                                program.compute.opt_state))
  if options.streamed:  # the update runs on the device
    state = dataclasses.replace(state, params=jax.device_put(state.params,
                                                             program.on_device.params))
  grad_norm = optax.tree.norm(grads)
  loss_scale = state.loss_scale
  # An overflow of scaled gradients, not a diverged run: the scale halves.
  overflow = (jnp.isfinite(loss) & ~jnp.isfinite(grad_norm) & (loss_scale.scale > 1)
              if loss_scale is not None else jnp.bool_(False))
  # The new weights and optimizer state must be finite too, whatever the cause
  # (a NaN learning rate, an overflow): a reduction over the update, which XLA
  # fuses with its arithmetic, so the branch still writes it in place.
  finite = (jnp.isfinite(loss) & jnp.isfinite(grad_norm) &
            _all_finite(_update(program.optimizer, state.params, state.opt_state, grads)))
  skip = options.nan_policy == "skip"
  healthy = finite if skip else finite & (state.nonfinite_steps == 0)
  params, opt_state = apply_update(program, state, grads, healthy)
  if program.offloaded:  # back to where the state lives
    params, opt_state = jax.device_put((params, opt_state),
                                       (program.shardings.params, program.shardings.opt_state))
  nonfinite_steps = state.nonfinite_steps + (~finite & ~overflow).astype(jnp.int32)
  metrics = {"loss": loss, "grad_norm": grad_norm, "nonfinite_steps": nonfinite_steps}
  model_state = state.model_state
  if program.stat_metrics is not None:
    metrics.update(program.stat_metrics(stats))
  if program.update_model_state is not None:
    model_state = jax.tree.map(lambda new, old: jnp.where(healthy, new, old),
                               program.update_model_state(model_state, stats), model_state)
  if loss_scale is not None:
    metrics["loss_scale"] = loss_scale.scale  # the scale this step ran with
    loss_scale = precision.adjust(loss_scale, finite, overflow, options.loss_scale_period)
    metrics["overflow_steps"] = loss_scale.overflow_steps
  if program.schedule is not None:
    metrics["learning_rate"] = program.schedule(state.step)
  counts = (healthy | skip | overflow).astype(jnp.int32)
  return dataclasses.replace(state, step=state.step + counts, params=params, opt_state=opt_state,
                             nonfinite_steps=nonfinite_steps, loss_scale=loss_scale,
                             model_state=model_state), metrics


def build_program(loss_fn: LossFn, names, optimizer: optax.GradientTransformation, mesh: Mesh,
                  rules: r.ShardingRules, shardings: TrainState, options: StepOptions,
                  schedule: optax.Schedule | None = None, grads_fn=None,
                  update_model_state=None, stat_metrics=None) -> Program:
  """The program of a step. `loss_fn(params, batch, model_state) -> (loss,
  counts)` (`LossFn`) and `names` the logical names of the params;
  `grads_fn(params, batch, model_state) -> (loss, counts, float32 grads)`
  replaces the differentiation of `loss_fn` (the pipeline brings its own,
  accumulation included; no loss scaling). `update_model_state` and
  `stat_metrics`: `ModelSpec`'s."""
  replicas = mesh.shape["data"] if options.replicas is None else options.replicas
  options = dataclasses.replace(options, replicas=replicas)
  grad_specs = jax.tree.map(lambda s: s.spec, r.tree_shardings(names, mesh, rules.grads))
  if grads_fn is not None:
    grads_fn = functools.partial(_unscaled, grads_fn)
  else:
    grads_fn = functools.partial(value_and_grad, loss_fn, options.grad_dtype)
    if options.grad_accum_steps > 1:
      # ZeRO 0/1 keep whole gradients per `data` replica: accumulate each
      # replica's own sum and reduce once per step, not once per microbatch.
      per_replica = (options.replica_sums and replicas > 1
                     and "data" not in jax.tree.leaves(jax.tree.map(tuple, grad_specs)))
      if per_replica:
        grads_fn = functools.partial(replica_value_and_grad, grads_fn, replicas, rules)
      grads_fn = functools.partial(accumulated, grads_fn, options.grad_accum_steps, grad_specs,
                                   options.grad_dtype, replicas if per_replica else 1)
  offloaded = is_offloaded(shardings)
  on_device = in_memory(shardings, "device") if offloaded else shardings
  compute = on_device if options.streamed is None else dataclasses.replace(
      on_device, params={**on_device.params,
                         options.streamed: shardings.params[options.streamed]})
  return Program(grads_fn, optimizer, update_model_state, stat_metrics, schedule, options,
                 r.tree_shardings(names, mesh, rules.params), shardings, on_device, compute,
                 offloaded)


def _unscaled(grads_fn, params, batch: Batch, model_state=None, scale=None):
  """A `grads_fn(params, batch, model_state)` as a GradsFn (the configs that
  bring their own refuse float16 loss scaling up front)."""
  assert scale is None, "this gradient function takes no loss scale"
  return grads_fn(params, batch, model_state)


class TrainStep:
  """`state, metrics = train_step(state, batch)`, compiled once, state donated."""

  def __init__(self, loss_fn: LossFn, names, optimizer: optax.GradientTransformation,
               mesh: Mesh, rules: r.ShardingRules, state_shardings: TrainState, *,
               schedule: optax.Schedule | None = None, grads_fn=None, update_model_state=None,
               stat_metrics=None, **options):
    """`options` are `StepOptions`' fields; `build_program` says the rest."""
    self.mesh, self.rules = mesh, rules
    self.batch_sharding = batch_sharding(mesh, rules)
    self.program = build_program(loss_fn, names, optimizer, mesh, rules, state_shardings,
                                 StepOptions(**options), schedule, grads_fn, update_model_state,
                                 stat_metrics)
    # meshtrain.analysis.selfcheck runs these alone
    self.loss_fn, self.grads_fn = loss_fn, self.program.grads_fn
    self._jitted = jax.jit(functools.partial(train_step, self.program),
                           in_shardings=(state_shardings, self.batch_sharding),
                           out_shardings=(state_shardings, None), donate_argnums=0,
                           compiler_options=xla_options.for_mesh(mesh))

  @contextlib.contextmanager
  def _context(self):
    """The mesh and the rules in force while tracing the model."""
    with jax.set_mesh(self.mesh), nnx.logical_axis_rules(self.rules.params):
      yield

  def __call__(self, state: TrainState, batch: Batch):
    with self._context():
      return self._jitted(state, batch)

  def lower(self, state: TrainState, batch: Batch,
            platforms: tuple[str, ...] | None = None) -> jax.stages.Lowered:
    """The step lowered for this machine, or for `platforms` (say `("cuda",)`
    on a CPU machine, to read what a GPU's XLA would receive)."""
    with self._context():
      return self._jitted.trace(state, batch).lower(lowering_platforms=platforms)
