"""Mixed precision: bfloat16 working weights and activations, float32 master
weights and optimizer state, training close to float32."""

import json
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import micro_config
from reference import random_batches, reference_run
from meshtrain.data import make_iterator
from meshtrain.train.loop import train
from meshtrain.train.setup import build

# The built-in learnable task (arithmetic progressions mod the vocabulary, see
# meshtrain/data/synthetic.py), long enough for the micro model to learn it:
# float32 goes from 4.57 to 1.27 in 40 steps (log(64) = 4.16).
LEARNING = {"mesh.data": 8, "steps": 40, "optimizer.learning_rate": 1e-2}


def task_batches(cfg) -> list[dict]:
  batches = make_iterator(cfg.data, seq_len=cfg.seq_len, global_batch=cfg.global_batch,
                          vocab_size=cfg.model.vocab_size, seed=cfg.seed)
  return [next(batches) for _ in range(cfg.steps)]


def update_differences(params, reference, initial) -> dict[str, float]:
  """Per weight: |(params - initial) - (reference - initial)| / |reference - initial|
  in the 2-norm, the difference between two runs' total updates, as a share of
  the float32 one (the weights themselves would hide it behind their
  initial values)."""
  flat = jax.tree_util.tree_flatten_with_path(params)[0]
  return {jax.tree_util.keystr(path, simple=True, separator="/"):
          float(np.linalg.norm(np.float64(p) - r) / np.linalg.norm(np.float64(r) - w))
          for (path, p), r, w in zip(flat, jax.tree.leaves(reference), jax.tree.leaves(initial))}


def test_bfloat16_training_tracks_float32_and_keeps_float32_state():
  cfg = micro_config(**LEARNING, param_dtype="bfloat16", compute_dtype="bfloat16")
  setup = build(cfg)
  state = setup.init_state()
  initial = jax.device_get(state.params)
  batches = task_batches(cfg)
  losses = []
  for batch in batches:
    state, metrics = setup.train_step(
        state, {k: jax.device_put(v, setup.train_step.batch_sharding) for k, v in batch.items()})
    losses.append(float(metrics["loss"]))
  assert {x.dtype for x in jax.tree.leaves((state.params, state.opt_state))} <= {
      jnp.dtype(jnp.float32), jnp.dtype(jnp.int32)}

  # The same model computing in float32 (the bfloat16 config's model casts its
  # activations to bfloat16 even from float32 weights), with its own optimizer,
  # plain jit on one device, from the same weights on the same batches.
  float32 = build(micro_config(**LEARNING))
  ref_losses, ref_params = reference_run(float32.spec.graphdef, initial, float32.optimizer,
                                         batches)
  assert ref_losses[-1] < 0.5 * math.log(cfg.model.vocab_size), ref_losses  # it learned
  # bfloat16 rounding, not drift: measured at most 0.006 apart. A bfloat16 run
  # with its learning rate 10% too high or low is 0.12 to 0.14 apart.
  np.testing.assert_allclose(losses, ref_losses, atol=0.02)
  # The weights' total updates, float32 master weights against float32. bfloat16
  # keeps 8 significant bits: each working weight, activation and activation
  # gradient is rounded by up to 2**-9 (0.2%), so each step's gradient is off by
  # tenths of a percent in every element, and 40 Adam steps (whose update does
  # not shrink with an element's gradient) add that noise up: 0.7% to 3.7% of the
  # update, per weight, measured. 10% leaves room for another CPU's bfloat16
  # arithmetic and is below what a wrong gradient does: a learning rate 10% off
  # moves every weight 11% to 17% off, the MLP's term of the residual stream's
  # gradient dropped 40% to 146%, one norm's gradient dropped 100% of its update
  # (while the losses stay within 0.01 of float32's).
  differences = update_differences(jax.device_get(state.params), ref_params, initial)
  assert max(differences.values()) < 0.1, differences


def text_config(workdir, dtype, text, **changes):
  """The tiny model on real text, bytes as tokens."""
  return micro_config(**{"param_dtype": dtype, "compute_dtype": dtype, "workdir": str(workdir),
                         "data.source": "text", "data.path": str(text),
                         "model.vocab_size": 256, "seq_len": 32, "checkpoint.every_steps": 0,
                         **changes})


@pytest.mark.slow
def test_float16_with_loss_scaling_trains_like_bfloat16_on_real_text(tmp_path, real_text):
  steps = {"steps": 40, "log_every": 5, "optimizer.learning_rate": 1e-2}
  fp16 = train(text_config(tmp_path / "fp16", "float16", real_text, **steps))
  bf16 = train(text_config(tmp_path / "bf16", "bfloat16", real_text, **steps))
  assert fp16[-1]["loss"] < fp16[0]["loss"] - 1.5  # it learned (5.5 -> about 3.3)
  assert abs(fp16[-1]["loss"] - bf16[-1]["loss"]) < 0.05
  assert fp16[-1]["nonfinite_steps"] == 0 and fp16[-1]["overflow_steps"] == 0


@pytest.mark.slow
def test_overflow_is_skipped_counted_and_the_scale_recovers_on_fsdp(tmp_path, real_text):
  """A scale of 2**30 overflows float16 (max 65504): each overflow halves it and
  drops the update without a nan_policy stop; `period` finite steps in a row
  double it. The scale and the count are in metrics.jsonl."""
  period = 4
  cfg = text_config(tmp_path, "float16", real_text, **{"mesh.data": 1, "mesh.fsdp": 8, "steps": 30,
                                            "nan_policy": "stop", "loss_scale.initial": 2.0**30,
                                            "loss_scale.period": period})
  records = train(cfg)
  assert [r["step"] for r in records] == list(range(1, 31))  # no stop
  assert all(r["nonfinite_steps"] == 0 for r in records)
  logged = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert [(r["loss_scale"], r["overflow_steps"]) for r in logged] == [
      (r["loss_scale"], r["overflow_steps"]) for r in records]
  # The rule, spelled out: halve after an overflow, double after `period` good steps.
  scale, good, overflows = 2.0**30, 0, 0
  for record in records:
    assert record["loss_scale"] == scale
    overflowed = record["overflow_steps"] > overflows
    overflows, good = record["overflow_steps"], 0 if overflowed else good + 1
    scale, good = (scale / 2, good) if overflowed else (scale * 2, 0) if good == period else (scale, good)
  scales = [r["loss_scale"] for r in records]
  assert overflows >= 10 and any(b == 2 * a for a, b in zip(scales, scales[1:]))
  assert records[-1]["loss"] < records[0]["loss"] - 0.5  # trains once the scale fits


def test_an_overflowed_step_changes_no_weight_or_optimizer_state():
  cfg = micro_config(**{"mesh.data": 1, "mesh.fsdp": 8, "param_dtype": "float16",
                        "compute_dtype": "float16", "loss_scale.initial": 2.0**40})
  setup = build(cfg)
  state = setup.init_state()
  before = jax.device_get((state.params, state.opt_state))
  batch = random_batches(1, cfg.global_batch, cfg.seq_len, cfg.model.vocab_size)[0]
  state, metrics = setup.train_step(
      state, {k: jax.device_put(v, setup.train_step.batch_sharding) for k, v in batch.items()})
  chex.assert_trees_all_equal(jax.device_get((state.params, state.opt_state)), before)
  assert (int(metrics["overflow_steps"]), int(metrics["nonfinite_steps"])) == (1, 0)
  assert (float(state.loss_scale.scale), int(state.step)) == (2.0**39, 1)


@pytest.mark.slow
def test_resume_is_exact_with_the_loss_scale(tmp_path, real_text):
  changes = {"steps": 8, "loss_scale.initial": 2.0**22, "loss_scale.period": 2,
             "checkpoint.every_steps": 4}
  straight = train(text_config(tmp_path / "straight", "float16", real_text, **changes))
  resumed = train(text_config(tmp_path / "resumed", "float16", real_text, **changes, **{
      "checkpoint.restore_from": str(tmp_path / "straight/checkpoints/4")}))
  pick = lambda records: [(r["step"], r["loss"], r["loss_scale"], r["overflow_steps"])
                          for r in records if r["step"] > 4]
  assert pick(resumed) == pick(straight)
  assert len({r["loss_scale"] for r in straight}) > 2  # the scale moved both ways
