"""Sharded training equals unsharded plain-jit training (float32): meshtrain's
run of a config beside `reference.reference_run` of the same model, initial
weights, optimizer and batches.

Tolerance: losses and parameters after a few AdamW steps agree to rtol 1e-5;
what differs is only the order of float32 reductions. Absolute: losses 1e-6,
parameters 1e-3 x the peak learning rate (3e-6 for the micro config, against
moves of up to 8e-3): Adam divides each gradient by its running RMS, so where
an element's gradients nearly cancel, a reordered float32 sum changes its update
by more than float32's epsilon (seen: 1.3e-6 once in 16,384 weights of the
8-layer interleaved pipeline on one x86 CPU), while a wrong gradient changes
updates by the order of the learning rate.
"""

import chex
import jax
import numpy as np

from reference import reference_run
from meshtrain.train.parallelize import from_stage_slots
from meshtrain.train.setup import build


def meshtrain_run(cfg, batches, with_metrics=False, devices=None):
  """meshtrain's setup, initial weights (and model state), losses and final
  weights on `batches` (and `with_metrics`, each step's metrics); weights and
  model state as the model holds them (its layers out of an uneven pipeline's
  slots). `devices`: those the mesh takes (default: all)."""
  setup = build(cfg, devices)
  state = setup.init_state()

  def model_own(tree):
    return jax.device_get(from_stage_slots(setup.run.layout, tree))
  initial, initial_model_state = model_own(state.params), model_own(state.model_state)
  logged = []
  for batch in batches:
    global_batch = {k: jax.device_put(v, setup.train_step.batch_sharding) for k, v in batch.items()}
    state, metrics = setup.train_step(state, global_batch)
    logged.append(jax.tree.map(float, metrics))
  run = (setup, (initial, initial_model_state), np.array([m["loss"] for m in logged]),
         model_own(state.params))
  return (*run, logged) if with_metrics else run


def assert_matches_one_device(cfg, batches, reference_optimizer=None, with_metrics=False):
  """Trains `cfg` with meshtrain and the reference on `batches` (with
  `reference_optimizer`, default meshtrain's own optax optimizer); asserts their
  losses and final weights agree. Returns (initial weights, losses, final
  weights) and, `with_metrics`, meshtrain's metrics of each step."""
  setup, (initial, model_state), losses, params, logged = meshtrain_run(cfg, batches,
                                                                        with_metrics=True)
  ref_losses, ref_params = reference_run(setup.spec.graphdef, initial,
                                         reference_optimizer or setup.optimizer, batches,
                                         model_state=model_state)
  chex.assert_trees_all_close(losses, ref_losses, rtol=1e-5, atol=1e-6)
  chex.assert_trees_all_close(params, ref_params, rtol=1e-5,
                              atol=1e-3 * cfg.optimizer.learning_rate)
  return (initial, losses, params, logged) if with_metrics else (initial, losses, params)
