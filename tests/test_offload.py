"""config.offload: the float32 master weights and optimizer state (`optimizer`)
or the layers' weights (`params`, fetched layer by layer) live in pinned host
memory; training is unchanged."""

import math
import re

import chex
import jax
import pytest

from conftest import micro_config, tiered
from reference import random_batches
from equivalence import meshtrain_run
from meshtrain.analysis import selfcheck
from meshtrain.analysis.plan import compile_step, plan


def host_input_bytes(compiled) -> int:
  """Bytes of the compiled step's per-device inputs placed in host memory (S(5))."""
  layout = compiled.as_text().splitlines()[0]
  inputs = layout[layout.index("entry_computation_layout={(") :].split(")->")[0]
  shapes = re.findall(r"([a-z]+\d+)\[([\d,]*)\]\{[^}]*S\(5\)[^}]*\}", inputs)
  return sum(int(dtype[1:]) // 8 * math.prod(map(int, filter(None, dims.split(","))))
             for dtype, dims in shapes)


# What each setting puts on the host: (params subtrees, optimizer state too).
SETTINGS = {"optimizer": (("embed", "head", "layers"), True), "params": (("layers",), False),
            "optimizer+params": (("embed", "head", "layers"), True)}


@pytest.mark.parametrize("setting", tiered(SETTINGS, ("optimizer+params",)))
def test_offloaded_state_lies_on_the_host_and_trains_the_same(setting):
  """Against the same run without offload: equal losses and weights; the state
  `config.offload` names lies in pinned host memory, and the compiled step
  takes exactly those bytes from the host, which `meshtrain plan` counts."""
  runs = {}
  for offload in ((), setting.split("+")):
    cfg = micro_config(**{"mesh.data": 1, "mesh.fsdp": 8,
                          **{f"offload.{part}": True for part in offload}})
    batches = random_batches(3, cfg.global_batch, cfg.seq_len, cfg.model.vocab_size)
    setup, _, losses, params = meshtrain_run(cfg, batches)
    runs[bool(offload)] = losses, params
  state = setup.init_state()
  on_host, optimizer = SETTINGS[setting]
  for name, subtree in state.params.items():
    kinds = {x.sharding.memory_kind for x in jax.tree.leaves(subtree)}
    assert kinds == {"pinned_host" if name in on_host else "device"}, name
  assert {x.sharding.memory_kind for x in jax.tree.leaves(state.opt_state)} == {
      "pinned_host" if optimizer else "device"}
  host_bytes = sum(x.addressable_shards[0].data.nbytes
                   for x in jax.tree.leaves((state.params, state.opt_state))
                   if x.sharding.memory_kind == "pinned_host")
  assert host_input_bytes(compile_step(setup)) == host_bytes
  # What `meshtrain plan` reports apart from the device's bytes.
  assert plan(setup.cfg, 8, compile_step=False)["analytic"]["memory_bytes"]["host"] == (
      pytest.approx(host_bytes, rel=1e-3))
  chex.assert_trees_all_close(runs[True], runs[False], rtol=1e-6, atol=0)


@pytest.mark.slow
def test_streamed_weights_in_bfloat16_with_recomputation_train_the_same():
  """The streamed layers are cast to the working dtype on the device, and the
  backward fetches them again under `remat=full`."""
  runs = []
  for offload in (False, True):
    cfg = micro_config(**{"mesh.data": 1, "mesh.fsdp": 4, "mesh.tensor": 2,
                          "param_dtype": "bfloat16", "remat": "full", "offload.params": offload})
    batches = random_batches(3, cfg.global_batch, cfg.seq_len, cfg.model.vocab_size)
    runs.append(meshtrain_run(cfg, batches)[2:])
  chex.assert_trees_all_close(runs[1], runs[0], rtol=1e-6, atol=0)


@pytest.mark.slow
def test_verify_runs_an_offloaded_config():
  """`meshtrain verify` on offloaded state: the first gradient from the weights
  brought to the device, then the offloaded steps, against plain jit."""
  cfg = micro_config(**{"mesh.data": 1, "mesh.fsdp": 8, "offload.optimizer": True,
                        "offload.params": True})
  report = selfcheck.verify_config(cfg)
  assert report.ok(), report.format()
