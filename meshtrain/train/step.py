"""The jitted train step: working-copy cast, gradient accumulation, AdamW update.

Precision: the state holds float32 master weights; forward and backward run on
a copy cast to `param_dtype` and laid out by the `params` rules (under ZeRO-1/2
that layout change is the parameter all-gather), activations in
`compute_dtype`, logits and loss in float32. Gradients are accumulated in
`grad_dtype` (float32 by default) in the layout of the `grads` rules.
"""

import contextlib
import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from meshtrain import rules as r
from meshtrain.parallel import offload
from meshtrain.train import precision
from meshtrain.train.microbatch import split_microbatches
from meshtrain.train.state import TrainState, in_memory, is_offloaded

Batch = dict[str, jax.Array]
LossFn = Callable[[dict, Batch], jax.Array]
GradsFn = Callable[[dict, Batch], tuple[jax.Array, dict]]
# Batch leaves are [batch, length, ...]: rows split over data x fsdp, tokens over sequence.
BATCH_NAMES = (r.BATCH, r.LENGTH)


def _trim(spec: P) -> P:
  """Without trailing unsharded dimensions, so the spec fits leaves of any rank."""
  parts = list(spec)
  while parts and parts[-1] is None:
    parts.pop()
  return P(*parts)


def _all_finite(tree) -> jax.Array:
  return jnp.all(jnp.stack([jnp.isfinite(x).all() for x in jax.tree.leaves(tree)]))


def batch_sharding(mesh: Mesh, rules: r.ShardingRules) -> NamedSharding:
  """The layout of every batch leaf."""
  return NamedSharding(mesh, _trim(r.logical_to_spec(BATCH_NAMES, rules.params)))


def _cast(tree, dtype):
  return jax.tree.map(lambda x: x.astype(dtype), tree)


class TrainStep:
  """`state, metrics = train_step(state, batch)`, compiled once, state donated."""

  def __init__(self, loss_fn: LossFn, names, optimizer: optax.GradientTransformation,
               mesh: Mesh, rules: r.ShardingRules, state_shardings: TrainState, *,
               grad_accum_steps: int = 1, param_dtype: str = "float32",
               grad_dtype: str = "float32", schedule: optax.Schedule | None = None,
               grads_fn: GradsFn | None = None, nan_policy: str = "stop",
               replicas: int | None = None, loss_scale_period: int = 2000,
               streamed: str | None = None):
    """`loss_fn(params, batch)` is the mean loss of a batch; `names` the logical
    names of the params. `grads_fn(params, batch) -> (loss, float32 grads)`
    replaces the differentiation of `loss_fn` (the pipeline brings its own);
    `schedule` gives the logged learning rate.

    A step whose loss, gradient norm, new weights or new optimizer state are
    not finite changes nothing but
    `nonfinite_steps`. Under `nan_policy="skip"` training goes on (`step`
    counts the dropped step); under "stop" the state stays frozen at the last
    good step from then on, so the loop can save it when it next looks.

    With a `state.loss_scale` (float16) the loss is scaled before the
    backward pass and the gradients unscaled after (`meshtrain.train.precision`);
    a step whose gradients overflow while its loss is finite is skipped, counted
    in `loss_scale.overflow_steps` and not as non-finite, and the scale halves.

    `replicas` is the data-parallel degree, by default the `data` axis; 1 where
    a caller maps the step over `data` itself (`step_fn`, as local SGD does).

    `streamed` names the params subtree that stays in host memory through the
    forward and backward (its shardings in `state_shardings` say
    "pinned_host"): the model fetches it layer by layer
    (`meshtrain.parallel.offload`); it comes to the device for the update.
    """
    self.mesh, self.rules = mesh, rules
    self.batch_sharding = batch_sharding(mesh, rules)
    param_shardings = r.tree_shardings(names, mesh, rules.params)
    grad_specs = jax.tree.map(lambda s: s.spec, r.tree_shardings(names, mesh, rules.grads))
    dtype = jnp.dtype(param_dtype)
    # Offloaded master weights and optimizer state come to the device for the
    # update and go back to the host after it.
    offloaded = is_offloaded(state_shardings)
    on_device = in_memory(state_shardings, "device") if offloaded else state_shardings
    # Where the forward and backward find the state: on the device but the streamed weights.
    compute_place = on_device if streamed is None else dataclasses.replace(
        on_device, params={**on_device.params, streamed: state_shardings.params[streamed]})
    replicas = mesh.shape["data"] if replicas is None else replicas
    # ZeRO 0/1 keep whole gradients per `data` replica: accumulate each replica's
    # own sum and reduce once per step, not once per microbatch.
    per_replica = (grad_accum_steps > 1 and replicas > 1 and
                   "data" not in jax.tree.leaves(jax.tree.map(tuple, grad_specs)))

    def value_and_grad(params, batch: Batch, scale=None):
      if scale is None:
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
      else:  # the backward pass starts from `scale`, not 1
        loss, backward = jax.vjp(lambda p: loss_fn(p, batch), params)
        grads, = backward(scale.astype(loss.dtype))
      return loss, _cast(grads, grad_dtype)

    def replica_value_and_grad(params, batch: Batch, scale=None):
      """Per-replica losses [data] and gradients [data, ...], not yet summed."""
      def by_replica(x):
        return x.reshape(replicas, x.shape[0] // replicas, *x.shape[1:])
      with nnx.logical_axis_rules(r.without_axis(rules.params, "data")):
        return jax.vmap(value_and_grad, in_axes=(None, 0, None), spmd_axis_name="data")(
            params, jax.tree.map(by_replica, batch), scale)

    def accumulated(params, batch: Batch, scale=None):
      """Mean loss and gradient over `grad_accum_steps` microbatches, summed in
      `grad_dtype` in the `grads` layout."""
      lead = (replicas,) if per_replica else ()
      specs = jax.tree.map(lambda s: P("data", *s) if per_replica else s, grad_specs)
      grads_fn = replica_value_and_grad if per_replica else value_and_grad

      def body(carry, microbatch):
        loss, grads = grads_fn(params, microbatch, scale)
        grads = jax.lax.with_sharding_constraint(grads, specs)
        return jax.tree.map(jnp.add, carry, (loss, grads)), None

      zeros = jax.lax.with_sharding_constraint(
          jax.tree.map(lambda p: jnp.zeros(lead + p.shape, grad_dtype), params), specs)
      (loss, grads), _ = jax.lax.scan(body, (jnp.zeros(lead, jnp.float32), zeros),
                                      split_microbatches(batch, grad_accum_steps))
      count = grad_accum_steps * (replicas if per_replica else 1)
      return jax.tree.map(lambda x: (x.sum(0) if per_replica else x) / count, (loss, grads))

    if grads_fn is None:
      grads_fn = value_and_grad if grad_accum_steps == 1 else accumulated
    self.loss_fn, self.grads_fn = loss_fn, grads_fn  # meshtrain.analysis.selfcheck runs them alone

    def step(state: TrainState, batch: Batch) -> tuple[TrainState, dict[str, jax.Array]]:
      if offloaded:
        state = dataclasses.replace(state, **jax.device_put(
            {"params": state.params, "opt_state": state.opt_state},
            {"params": compute_place.params, "opt_state": compute_place.opt_state}))
      working = state.params
      if streamed is None:
        working = jax.lax.with_sharding_constraint(_cast(working, dtype), param_shardings)
      else:  # the streamed weights are cast on the device, one layer at a time
        rest = {k: v for k, v in working.items() if k != streamed}
        working = {**jax.lax.with_sharding_constraint(
            _cast(rest, dtype), {k: param_shardings[k] for k in rest}), streamed: working[streamed]}
      loss_scale = state.loss_scale
      with offload.streaming(dtype) if streamed else contextlib.nullcontext():
        if loss_scale is None:
          loss, grads = grads_fn(working, batch)
        else:
          loss, grads = grads_fn(working, batch, loss_scale.scale)
          grads = jax.tree.map(lambda g: g / loss_scale.scale, grads)
      if streamed:  # the update runs on the device; the streamed gradients came back to the host
        state = dataclasses.replace(state, params=jax.device_put(state.params, on_device.params))
        grads = jax.device_put(grads, jax.memory.Space.Device)
      # Gradients meet the optimizer in its layout: an all-reduce for replicated
      # state, a reduce-scatter for sharded state (ZeRO, FSDP).
      grads = jax.lax.with_sharding_constraint(grads, on_device.params)
      grad_norm = optax.tree.norm(grads)
      # An overflow of scaled gradients, not a diverged run: the scale halves.
      overflow = (jnp.isfinite(loss) & ~jnp.isfinite(grad_norm) & (loss_scale.scale > 1)
                  if loss_scale is not None else jnp.bool_(False))

      def update(params, opt_state, grads):
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

      # The new weights and optimizer state must be finite too, whatever the cause
      # (a NaN learning rate, an overflow): a reduction over the update, which XLA
      # fuses with its arithmetic, so the branch below still writes it in place.
      finite = (jnp.isfinite(loss) & jnp.isfinite(grad_norm) &
                _all_finite(update(state.params, state.opt_state, grads)))
      healthy = finite if nan_policy == "skip" else finite & (state.nonfinite_steps == 0)

      def keep(params, opt_state, grads):
        return params, opt_state

      # A branch, not a select of new and old state: a select still needs each
      # old optimizer moment when the new one is written over it (the donated
      # buffer), so XLA copied every moment, twice the weights' bytes, each step.
      params, opt_state = jax.lax.cond(healthy, update, keep, state.params, state.opt_state, grads)
      if offloaded:
        params, opt_state = jax.device_put((params, opt_state),
                                           (state_shardings.params, state_shardings.opt_state))
      counts = healthy | (nan_policy == "skip") | overflow
      nonfinite_steps = state.nonfinite_steps + (~finite & ~overflow).astype(jnp.int32)
      metrics = {"loss": loss, "grad_norm": grad_norm, "nonfinite_steps": nonfinite_steps}
      if loss_scale is not None:
        metrics["loss_scale"] = loss_scale.scale  # the scale this step ran with
        loss_scale = precision.adjust(loss_scale, finite, overflow, loss_scale_period)
        metrics["overflow_steps"] = loss_scale.overflow_steps
      if schedule is not None:
        metrics["learning_rate"] = schedule(state.step)
      return dataclasses.replace(state, step=state.step + counts.astype(jnp.int32), params=params,
                                 opt_state=opt_state, nonfinite_steps=nonfinite_steps,
                                 loss_scale=loss_scale), metrics

    self.step_fn = step  # unjitted, for callers that transform it

    self._jitted = jax.jit(step, in_shardings=(state_shardings, self.batch_sharding),
                           out_shardings=(state_shardings, None), donate_argnums=0)

  @contextlib.contextmanager
  def _context(self):
    """The mesh and the rules in force while tracing the model."""
    with jax.set_mesh(self.mesh), nnx.logical_axis_rules(self.rules.params):
      yield

  def __call__(self, state: TrainState, batch: Batch):
    with self._context():
      return self._jitted(state, batch)

  def lower(self, state: TrainState, batch: Batch) -> jax.stages.Lowered:
    with self._context():
      return self._jitted.lower(state, batch)
