"""A step whose new weights or optimizer state are not finite is never applied
nor saved, even when its loss and gradients are finite (a NaN learning rate)."""

import math

import chex
import jax
import numpy as np
import pytest

from conftest import micro_config
from meshtrain.checkpoint import Checkpoints
from meshtrain.errors import TrainingHalted
from meshtrain.train.loop import train
from meshtrain.train.setup import build


class _Position:
  """Stands in for the data iterator when only the state is read back."""

  def set_state(self, _):
    pass


def test_a_nan_learning_rate_never_reaches_a_checkpoint_and_a_sane_rerun_resumes(tmp_path):
  # The API path (the CLI refuses a NaN learning rate up front); the loss and
  # gradients of step 1 are finite, only the update is not.
  cfg = micro_config(steps=2, workdir=str(tmp_path))
  cfg.optimizer.learning_rate = math.nan
  with pytest.raises(TrainingHalted, match=r"not finite at step 1; the last good state \(step 0\)"):
    train(cfg)
  setup = build(cfg)
  saved = Checkpoints(tmp_path / "checkpoints", read_only=True, config_key="test")
  state = saved.restore(0, setup.shardings, setup.abstract_state(), _Position(), cfg)
  saved.close()
  # The saved weights are the initial ones (a fresh init with the same seed), not NaN.
  chex.assert_trees_all_equal(state.params, jax.device_get(setup.init_state().params))

  cfg.optimizer.learning_rate = 1e-3
  records = train(cfg)
  assert [r["step"] for r in records] == [1, 2]
  assert all(np.isfinite(r["loss"]) and r["nonfinite_steps"] == 0 for r in records)
