"""config.offload: the float32 master weights and optimizer state (`optimizer`)
or the layers' weights (`params`, fetched layer by layer) live in pinned host
memory, and `remat="offload"` keeps the weight matmuls' outputs there; training
is unchanged.

On a CPU host and device are one memory, so equal losses cannot show where
bytes live: the program a GPU's XLA would receive (the step lowered for
"cuda" on this machine) shows it, through its placements
(`meshtrain.analysis.hlo.placements`)."""

import collections
import math
import re

import chex
import jax
import pytest

from conftest import micro_config, tiered
from reference import random_batches
from equivalence import assert_matches_one_device, meshtrain_run
from meshtrain.analysis import hlo, selfcheck
from meshtrain.planner.plan import compile_step, plan
from meshtrain.train.setup import build


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


def offload_run(offload=()):
  """meshtrain's run of the micro config on fsdp=8 with `offload`'s parts
  (config.offload) on the host: setup, initial weights, losses, final weights."""
  cfg = micro_config(**{"mesh.data": 1, "mesh.fsdp": 8,
                        **{f"offload.{part}": True for part in offload}})
  batches = random_batches(3, cfg.global_batch, cfg.seq_len, cfg.model.vocab_size)
  return meshtrain_run(cfg, batches)


@pytest.fixture(scope="module")
def without_offload():
  """The run every setting is compared with: trained once for the module."""
  return offload_run()[2:]


@pytest.mark.parametrize("setting", tiered(SETTINGS, ("optimizer+params",)))
def test_offloaded_state_lies_on_the_host_and_trains_the_same(setting, without_offload):
  """Against the same run without offload: equal losses and weights; the state
  `config.offload` names lies in pinned host memory, and the compiled step
  takes exactly those bytes from the host, which `meshtrain plan` counts."""
  setup, _, losses, params = offload_run(setting.split("+"))
  runs = {True: (losses, params), False: without_offload}
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


def gpu_placements(cfg) -> list[hlo.Placement]:
  """The placements of `cfg`'s train step as lowered for a GPU, and the state."""
  setup = build(cfg)
  state = setup.init_state()
  batch = random_batches(1, cfg.global_batch, cfg.seq_len, cfg.model.vocab_size)[0]
  batch = {k: jax.device_put(v, setup.train_step.batch_sharding) for k, v in batch.items()}
  lowered = setup.train_step.lower(state, batch, platforms=("cuda",))
  return hlo.placements(lowered.compiler_ir("hlo").as_hlo_text()), state


@pytest.mark.parametrize("remat", tiered(("none", "full", "selective"), ("none",)))
def test_streamed_weights_come_to_the_device_inside_the_layer_loop(remat):
  """With `offload.params` each layer's weights come to the device inside the
  layers' loop, once in the forward and again in the backward (never the
  whole stack kept there), and each layer's gradient goes back to the host
  in the backward's loop: one placement per weight per direction."""
  cfg = micro_config(**{"mesh.data": 1, "mesh.fsdp": 8, "offload.params": True, "remat": remat})
  found, state = gpu_placements(cfg)
  per_layer = collections.Counter(x.shape[1:] for x in jax.tree.leaves(state.params["layers"]))
  in_loop = {memory: collections.Counter(p.dims for p in found if p.in_loop and p.memory == memory)
             for memory in ("device", "pinned_host")}
  assert in_loop["device"] == {dims: 2 * n for dims, n in per_layer.items()}
  assert in_loop["pinned_host"] == per_layer


def test_offloaded_optimizer_state_comes_to_the_device_for_the_update_and_back():
  """With `offload.optimizer` every leaf of the state on the host is placed on
  the device once a step: the master weights as the step starts, the optimizer
  state only past a barrier with the gradients (so the forward and backward
  run without it on the device); as many computed values go back to the host
  (jax's own output annotations aside); nothing moves in a loop."""
  cfg = micro_config(**{"mesh.data": 1, "mesh.fsdp": 8, "offload.optimizer": True})
  found, state = gpu_placements(cfg)
  on_host = {i for i, x in enumerate(jax.tree.leaves(state))
             if x.sharding.memory_kind == "pinned_host"}
  moments = {id(x) for x in jax.tree.leaves(state.opt_state)}
  optimizer_state = {i for i, x in enumerate(jax.tree.leaves(state)) if id(x) in moments}
  assert len(on_host) == len(jax.tree.leaves((state.params, state.opt_state)))
  assert {p.parameter for p in found if p.memory == "device"} - {None} == on_host
  assert {p.parameter for p in found if p.memory == "device" and p.after_barrier} == (
      optimizer_state & on_host)
  moved_back = [p for p in found if p.memory == "pinned_host" and p.parameter is None
                and not p.replaced]
  assert len(moved_back) == len(on_host)
  assert not any(p.in_loop for p in found)


def test_offloaded_activations_go_to_the_host_per_layer_and_train_like_none():
  """`remat="offload"`: the weight matmuls' outputs that the backward needs go
  to the host inside the forward's layer loop and come back inside the
  backward's, one placement each way; the run equals plain jit (no
  recomputation changes a value), and `plan` counts those bytes on the host,
  not on the device."""
  cfg = micro_config(**{"mesh.data": 2, "mesh.fsdp": 4, "remat": "offload"})
  found, _ = gpu_placements(cfg)
  to_host = collections.Counter(p.dims for p in found if p.in_loop and p.memory == "pinned_host")
  back = collections.Counter(p.dims for p in found if p.in_loop and p.memory == "device")
  assert to_host and to_host == back
  # activations ([2,] batch, length, ...), not weights
  assert all(dims[dims[0] == 2:][:2] == (cfg.global_batch, cfg.seq_len) for dims in to_host)
  batches = random_batches(3, cfg.global_batch, cfg.seq_len, cfg.model.vocab_size)
  assert_matches_one_device(cfg, batches)
  memory = {remat: plan(micro_config(**{"mesh.data": 2, "mesh.fsdp": 4, "remat": remat}), 8,
                        compile_step=False)["analytic"]["memory_bytes"]
            for remat in ("offload", "selective")}
  assert memory["offload"]["host_activations"] == memory["selective"]["activations"] - (
      memory["offload"]["activations"])
  assert 0 < memory["offload"]["activations"] < memory["selective"]["activations"]
