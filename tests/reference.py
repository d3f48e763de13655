"""The independent baseline every strategy is checked against: the same model,
unsharded, one device, plain `jax.jit`, the same optax optimizer, a train step
written here and not shared with meshtrain's."""

import functools

import jax
import numpy as np
import optax
from flax import nnx


@functools.partial(jax.jit, static_argnames=("graphdef", "apply", "optimizer"))
def _step(params, opt_state, batch, model_state, *, graphdef, apply, optimizer):
  """One plain step: loss, gradients, update (compiled once per model and optimizer)."""
  def loss_fn(p):
    packed = {k: batch[k] for k in ("segment_ids", "positions") if k in batch}
    state = [model_state] if model_state is not None else []
    logits = (apply(p, batch["inputs"]) if apply
              else nnx.merge(graphdef, p, *state)(batch["inputs"], **packed))
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
    counted = np.ones(losses.shape, bool)
    if "segment_ids" in batch:  # packed documents: padding's targets do not count
      counted = counted & (batch["segment_ids"] != 0)
    if "loss_mask" in batch:  # conversations: only the assistant's tokens count
      counted = counted & (batch["loss_mask"] != 0)
    return (losses * counted).sum() / counted.sum()
  loss, grads = jax.value_and_grad(loss_fn)(params)
  updates, opt_state = optimizer.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state, loss


def reference_run(graphdef, params, optimizer, batches, apply=None, opt_state=None,
                  model_state=None):
  """Losses and final parameters of len(batches) plain steps from `params`: an
  NNX model (`graphdef`, with its `model_state` if it has one, held fixed) or
  any `apply(params, inputs) -> logits`. With `opt_state` given (a run that
  goes on), also returns the final one."""
  device = jax.devices()[0]
  params = jax.device_put(jax.device_get(params), device)
  goes_on = opt_state is not None
  opt_state = jax.device_put(opt_state if goes_on else jax.jit(optimizer.init)(params), device)
  losses = []
  for batch in batches:
    params, opt_state, loss = _step(params, opt_state, jax.device_put(batch, device),
                                    model_state, graphdef=graphdef, apply=apply,
                                    optimizer=optimizer)
    losses.append(float(loss))
  if goes_on:
    return np.array(losses), jax.device_get(params), opt_state
  return np.array(losses), jax.device_get(params)


def random_batches(count: int, batch: int, length: int, vocab: int, seed: int = 0):
  rng = np.random.default_rng(seed)
  def one():
    tokens = rng.integers(0, vocab, (batch, length + 1), dtype=np.int32)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
  return [one() for _ in range(count)]
