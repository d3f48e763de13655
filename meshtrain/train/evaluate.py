"""Held-out evaluation: mean loss and perplexity on fixed validation batches, on the training mesh.

The batches are the first `config.eval.batches` global batches of the
validation split, drawn once, so every evaluation of a run (and `meshtrain
eval` of its checkpoints) sees the same tokens. Each process keeps only its
rows, as in training. The loss is the training loss (`Setup.loss_fn`, so
packing and masking agree: the mean over the counted tokens of all the
batches, `meshtrain.train.loss`), run forward only on the weights as the step sees
them (cast to `param_dtype`, laid out by the `params` rules), over the
`grad_accum_steps` microbatches of a batch in turn so the activations stay
those of one training microbatch; on a pipeline mesh, through the pipeline's
forward-only schedule. It is compiled once: every call has the same shapes
and shardings.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from meshtrain import rules as r
from meshtrain.data import make_iterator
from meshtrain.data.placement import process_rows, to_global
from meshtrain.errors import ConfigError
from meshtrain.train import pipelined
from meshtrain.train.loss import counted_tokens, with_loss_weights
from meshtrain.train.microbatch import split_microbatches
from meshtrain.train.relayout import read_weights
from meshtrain.train.setup import Setup, build


class Evaluator:
  """`evaluator(params, model_state) -> {"eval_loss", "eval_perplexity"}` for
  the master weights (and model state) of a train state."""

  def __init__(self, setup: Setup):
    cfg = setup.cfg
    if cfg.eval.batches < 1:
      raise ConfigError("config.eval.batches", f"is {cfg.eval.batches}; evaluate at least 1 batch")
    loss_fn = _loss_fn(setup)
    sharding = setup.train_step.batch_sharding
    batch_shape = (cfg.global_batch, cfg.seq_len)
    batches = make_iterator(cfg.data, seq_len=cfg.seq_len, global_batch=cfg.global_batch,
                            vocab_size=cfg.model.vocab_size, seed=cfg.seed,
                            rows=process_rows(sharding, batch_shape), split="val")
    self._batches = [to_global(next(batches), sharding, batch_shape)
                     for _ in range(cfg.eval.batches)]
    self._setup = setup
    self.every_steps, self.last_step = cfg.eval.every_steps, cfg.steps
    self.traces = 0  # how often the loss was traced (compiled): once per run
    param_shardings = r.tree_shardings(setup.spec.names, setup.mesh, setup.rules.params)
    dtype = jnp.dtype(cfg.param_dtype)

    def mean_loss(params, batch, model_state):
      """The batch's mean loss over its counted tokens, and how many count."""
      self.traces += 1
      working = jax.lax.with_sharding_constraint(
          jax.tree.map(lambda x: x.astype(dtype), params), param_shardings)
      counted_BxL = counted_tokens(batch)
      count = (jnp.float32(batch["targets"].size) if counted_BxL is None
               else counted_BxL.sum(dtype=jnp.float32))
      return loss_fn(working, with_loss_weights(batch), model_state), count

    self._jitted = jax.jit(mean_loss, in_shardings=(setup.shardings.params,
                                                    setup.train_step.batch_sharding,
                                                    setup.shardings.model_state))

  def due(self, step: int) -> bool:
    """Whether the run evaluates after `step`: every `eval.every_steps` and at the last step."""
    return bool(self.every_steps) and (step % self.every_steps == 0 or step == self.last_step)

  def __call__(self, params, model_state=None) -> dict[str, float]:
    with jax.set_mesh(self._setup.mesh), nnx.logical_axis_rules(self._setup.rules.params):
      losses, counts = zip(*(self._jitted(params, batch, model_state)
                             for batch in self._batches))
    counts = np.asarray(jax.device_get(counts))
    # The mean over every counted token of the batches (none counted: undefined).
    loss = (float(np.average(jax.device_get(losses), weights=counts)) if counts.sum()
            else float("nan"))
    return {"eval_loss": loss, "eval_perplexity": math.exp(min(loss, 700.0))}


def _loss_fn(setup: Setup):
  """(params, batch, model_state) -> mean loss, forward only: the pipeline's
  forward schedule on a pipeline mesh, else the training loss over the step's
  `grad_accum_steps` microbatches in turn."""
  run = setup.run
  if run.pipelined:
    return pipelined.pipelined_loss(setup.spec, run.cfg.pipeline, run.mesh, run.rules,
                                    layout=run.layout)

  def microbatched(params, batch, model_state):
    losses = jax.lax.map(lambda microbatch: setup.loss_fn(params, microbatch, model_state)[0],
                         split_microbatches(batch, run.cfg.grad_accum_steps))
    return jnp.mean(losses)
  return microbatched


def evaluator_for(setup: Setup) -> Evaluator | None:
  """The run's evaluator, or None where `config.eval.every_steps` is 0."""
  cfg = setup.cfg
  if cfg.eval.every_steps < 0:
    raise ConfigError("config.eval.every_steps", f"is {cfg.eval.every_steps}; use 0 (no "
                      "evaluation) or the steps between evaluations")
  return Evaluator(setup) if cfg.eval.every_steps else None


def evaluate_checkpoint(cfg, workdir: str, step: int) -> dict:
  """Evaluates the weights of checkpoint `step` in `workdir` on `cfg`'s mesh."""
  setup = build(cfg)
  evaluator = Evaluator(setup)
  params, model_state = read_weights(workdir, step, setup)
  return {"step": step, **evaluator(params, model_state)}
