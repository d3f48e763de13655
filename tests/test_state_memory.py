"""The train state's bytes a device holds (`train.state_memory`), against the
shards of the state the setup builds, and the refusal of a state that
outgrows a device before anything is allocated."""

import math

import jax
import jax.numpy as jnp
import pytest
from conftest import micro_config

from meshtrain import rules
from meshtrain.errors import ConfigError
from meshtrain.train import state_memory
from meshtrain.train.loop import train
from meshtrain.train.setup import build


def held_bytes(setup) -> int:
  """What the step holds of the state, read from the built setup: the stored
  weights and optimizer state (their shards), and the working weights in the
  layout and dtype the model computes with, where they are another copy
  (ZeRO-1's gathered weights, a bfloat16 working copy)."""
  state = jax.eval_shape(setup.init_state)
  compute = jax.tree.leaves(rules.tree_shardings(setup.spec.names, setup.mesh,
                                                 setup.rules.params))
  working_dtype = jnp.dtype(setup.cfg.param_dtype)
  held = 0
  for stored, sharding, layout in zip(jax.tree.leaves(state.params),
                                      jax.tree.leaves(setup.shardings.params), compute):
    held += math.prod(sharding.shard_shape(stored.shape)) * stored.dtype.itemsize
    if stored.dtype != working_dtype or sharding.spec != layout.spec:
      held += math.prod(layout.shard_shape(stored.shape)) * working_dtype.itemsize
  return held + sum(math.prod(s.shard_shape(x.shape)) * x.dtype.itemsize for x, s in zip(
      jax.tree.leaves(state.opt_state), jax.tree.leaves(setup.shardings.opt_state)))


@pytest.mark.parametrize("layout", [
    {"mesh.fsdp": 8, "mesh.data": 1},
    {"mesh.data": 8, "zero_stage": 1},
    {"mesh.data": 2, "mesh.fsdp": 2, "mesh.tensor": 2, "param_dtype": "bfloat16"},
    {"mesh.data": 4, "mesh.pipeline": 2}], ids=["fsdp", "zero1", "hsdp+tp bf16", "pipeline"])
def test_the_weights_and_optimizer_state_are_what_the_setup_lays_out(layout):
  setup = build(micro_config(**layout))
  counted = state_memory.state_bytes(setup.cfg, setup.spec, setup.rules, setup.mesh)
  # the optimizer's step counts and the loss scale are a few scalars
  assert counted["params"] + counted["optimizer"] == pytest.approx(held_bytes(setup), rel=0.01)
  assert counted["grads"] > 0 and counted["host"] == 0


def test_a_state_that_outgrows_a_device_is_refused_naming_the_mesh(monkeypatch, tmp_path):
  cfg = micro_config(**{"mesh.fsdp": 8, "mesh.data": 1}, workdir=str(tmp_path / "run"))
  setup = build(cfg)
  state = sum(v for k, v in state_memory.state_bytes(
      cfg, setup.spec, setup.rules, setup.mesh).items() if k != "host")
  monkeypatch.setattr(state_memory, "device_memory", lambda device: int(state) - 1)
  with pytest.raises(ConfigError, match=r"^config\.mesh: the train state alone .* needs "
                                        r"0\.0 GiB a device, more than the 0\.0 GiB one has"):
    train(cfg)
  assert not (tmp_path / "run").exists()  # refused before anything was written
  monkeypatch.setattr(state_memory, "device_memory", lambda device: int(state))
  state_memory.check_fits(setup)  # exactly what it holds: fits
