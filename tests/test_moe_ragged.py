"""`experts.dispatch=ragged`: the experts' all-to-alls by
`lax.ragged_all_to_all`, which sends each device's real rows alone.

XLA:CPU cannot compile that collective, so here it is replaced by an
emulation written from its documented semantics (the pseudocode of
`jax.lax.ragged_all_to_all`'s docstring, checked on the docstring's own
example), and the layer and the training step with it are compared with a
plain loop over experts and with one device. The program XLA would receive
holds the real collective: that is read from the lowered step."""

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

from conftest import micro_config, tiered
from equivalence import assert_matches_one_device
from reference import random_batches
from test_moe import (MOE, MESHES, STEPS, TENSOR_DISPATCH, mesh_of,
                      assert_split_experts_equal_the_plain_loop,
                      assert_tensor_shares_equal_one_device)
from meshtrain.errors import ConfigError
from meshtrain.parallel import experts
from meshtrain.planner.plan import format_plan, plan
from meshtrain.train.setup import build


def emulated_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets,
                               recv_sizes, *, axis_name, axis_index_groups=None):
  """`jax.lax.ragged_all_to_all` as its docstring specifies it: slice i of the
  K = n x per slices goes to device i // per, which writes it at
  all_to_all(output_offsets)[i'] for its i'; built of an all-to-all, a
  gather and a scatter, so that autodiff gives its transpose."""
  assert axis_index_groups is None
  axes = axis_name if isinstance(axis_name, tuple) else (axis_name,)
  n = math.prod(jax.sharding.get_abstract_mesh().shape[a] for a in axes)
  k, rows = input_offsets.shape[0], operand.shape[0]
  r_N = jnp.arange(rows)
  sent_KxN = operand.at[input_offsets[:, None] + r_N].get(mode="fill", fill_value=0)
  sent_KxN = jnp.where((r_N < send_sizes[:, None]).reshape(k, rows, *[1] * (operand.ndim - 1)),
                       sent_KxN, 0)
  received_KxN = lax.all_to_all(sent_KxN.reshape(n, k // n, *sent_KxN.shape[1:]), axes, 0, 0,
                                tiled=True).reshape(sent_KxN.shape)
  at_K = lax.all_to_all(output_offsets.reshape(n, k // n), axes, 0, 0, tiled=True).reshape(k)
  target_KxN = jnp.where(r_N < recv_sizes[:, None], at_K[:, None] + r_N, output.shape[0])
  return output.at[target_KxN.reshape(-1)].set(
      received_KxN.reshape(k * rows, *operand.shape[1:]), mode="drop")


@pytest.fixture
def accepted(monkeypatch):
  """The trainer told that the collective runs here."""
  monkeypatch.setattr(experts, "ragged_unsupported", lambda device: "")


@pytest.fixture
def emulated(monkeypatch, accepted):
  """The emulation in the real collective's place."""
  monkeypatch.setattr(lax, "ragged_all_to_all", emulated_ragged_all_to_all)


def test_the_emulation_gives_the_docstrings_example():
  """The example of `jax.lax.ragged_all_to_all`'s docstring on an axis of 2."""
  mesh = mesh_of(fsdp=2)
  args = {"operand": [[1, 2, 2], [3, 4, 0]], "output": [[0] * 4] * 2,
          "input_offsets": [[0, 1], [0, 1]], "send_sizes": [[1, 2], [1, 1]],
          "output_offsets": [[0, 0], [1, 2]], "recv_sizes": [[1, 1], [2, 1]]}
  run = jax.shard_map(lambda *a: emulated_ragged_all_to_all(*(x[0] for x in a),
                                                            axis_name="fsdp")[None],
                      mesh=mesh, in_specs=P("fsdp"), out_specs=P("fsdp"))
  result = jax.jit(run)(*(jnp.asarray(v, jnp.int32) for v in args.values()))
  np.testing.assert_array_equal(result, [[1, 3, 0, 0], [2, 2, 4, 0]])


SPLIT = [name for name in MESHES if name != "no expert parallelism, data=8"]


@pytest.mark.parametrize("name", SPLIT)
def test_ragged_dispatch_equals_the_plain_loop(emulated, name):
  """Values and gradients of the layer, experts split over the mesh and the
  rows sent ragged, against the plain loop over experts."""
  assert_split_experts_equal_the_plain_loop(name, dispatch="ragged")


@pytest.mark.parametrize("case", TENSOR_DISPATCH)
def test_ragged_dispatch_of_tensor_shares_with_capacity_drops_equals_one_device(emulated, case):
  """tensor=2 x fsdp=4, each tensor device sending its share, a router skewed
  to one expert (so that a capacity drops and the sends are uneven): values,
  gradients and dropped counts equal the layer on one device."""
  assert_tensor_shares_equal_one_device(case, dispatch="ragged")


RAGGED = {**MOE, "experts.dispatch": "ragged"}
COMPOSITIONS = {
    "fsdp=8": dict(mesh=dict(data=1, fsdp=8)),
    "expert_parallel=data,fsdp accumulate 2": dict(mesh=dict(data=2, fsdp=4),
                                                  expert_parallel="data,fsdp", grad_accum_steps=2),
    "tensor=2 fsdp=4 sequence parallel capacity 1.25": dict(
        mesh=dict(data=1, fsdp=4, tensor=2), tensor_sequence_parallel=True,
        model=dict(moe=dict(capacity_factor=1.25))),
    "sequence=2 fsdp=4 ring": dict(mesh=dict(data=1, fsdp=4, sequence=2),
                                   attention=dict(sequence_strategy="ring")),
    "pipeline=2 fsdp=4 1f1b": dict(mesh=dict(data=1, pipeline=2, fsdp=4)),
    "pipeline=2 fsdp=4 zb_h1, remat full": dict(mesh=dict(data=1, pipeline=2, fsdp=4),
                                                pipeline=dict(schedule="zb_h1"), remat="full"),
}


@pytest.mark.parametrize("case", tiered(COMPOSITIONS, ("fsdp=8", "pipeline=2 fsdp=4 1f1b")))
def test_ragged_dispatch_training_matches_unsharded_plain_jit(emulated, case):
  cfg = micro_config(**RAGGED)
  cfg.update(COMPOSITIONS[case])
  batches = random_batches(STEPS, cfg.global_batch, cfg.seq_len, cfg.model.vocab_size)
  assert_matches_one_device(cfg, batches)


@pytest.mark.slow
def test_local_sgd_replicas_with_ragged_dispatch_equal_diloco_written_out(emulated):
  """Each replica's experts over `fsdp` x `tensor`, the rows sent ragged
  inside the vmap over replicas."""
  from test_local_sgd import MOE as LOCAL_MOE, assert_equals_diloco_written_out
  assert_equals_diloco_written_out({**LOCAL_MOE, "mesh.fsdp": 2, "mesh.tensor": 2,
                                    "experts.dispatch": "ragged"})


def lowered_collectives(cfg) -> dict[str, list[str]]:
  """The lowered (StableHLO) training step's all-to-alls, ragged and whole, by
  their operand types."""
  setup = build(cfg)
  state = setup.init_state()
  batch = random_batches(1, cfg.global_batch, cfg.seq_len, cfg.model.vocab_size)[0]
  text = setup.train_step.lower(state, jax.device_put(
      batch, setup.train_step.batch_sharding)).as_text()
  found = {"ragged": [], "whole": []}
  for line in text.splitlines():
    if "ragged_all_to_all" in line and "custom_call" in line:
      found["ragged"].append(re.search(r"\(tensor<([^>]*)>", line.split(":", 1)[1]).group(1))
    elif "stablehlo.all_to_all" in line:
      found["whole"].append(re.search(r"\(tensor<([^>]*)>", line.split(":", 1)[1]).group(1))
  return found


def test_the_step_xla_receives_sends_the_rows_by_ragged_all_to_all(accepted):
  """The lowered step of fsdp=8 with the real collective (lowering runs on a
  CPU; compiling would not; the layers share one scanned body): the MoE layer
  sends its T x K rows by ragged_all_to_all into n buckets of the capacity
  and takes them back, and the backward's transposes do the same the other
  way; no whole all-to-all moves activations. The padded step moves the
  buckets whole instead."""
  n, t, k, d = 8, 2 * 16, 2, 32  # micro model: a device's 2 sequences of 16 tokens
  capacity = experts.expert_capacity(t, 2, k, 1)
  found = lowered_collectives(micro_config(**RAGGED, **{"mesh.data": 1, "mesh.fsdp": 8}))
  assert sorted(found["ragged"]) == sorted([f"{t * k}x{d}xf32", f"{n * capacity}x{d}xf32"] * 2)
  assert not [s for s in found["whole"] if s.endswith(f"x{d}xf32")], found["whole"]
  # Local SGD's replicas, a vmap over `data`: jax's batching rule of the collective.
  from test_local_sgd import local_config
  replicas = lowered_collectives(local_config(2, **{**RAGGED, "mesh.data": 2, "mesh.fsdp": 4}))
  assert len(replicas["ragged"]) == 4, replicas["ragged"]
  padded = lowered_collectives(micro_config(**MOE, **{"mesh.data": 1, "mesh.fsdp": 8}))
  assert not padded["ragged"]
  assert [s for s in padded["whole"] if s.endswith(f"x{d}xf32")] == [f"{n}x{capacity}x{d}xf32"] * 4


def test_ragged_dispatch_on_a_cpu_is_refused_naming_the_key():
  cfg = micro_config(**RAGGED, **{"mesh.data": 1, "mesh.fsdp": 8})
  with pytest.raises(ConfigError, match=r"config\.experts\.dispatch.*XLA:CPU.*use padded"):
    build(cfg)
  cfg.expert_parallel = ""  # no expert parallelism: no all-to-all to make ragged
  build(cfg)


def test_plan_counts_the_rows_a_ragged_dispatch_sends():
  """On balanced routing a device sends (n - 1) / n of its T x K assignments'
  rows away and gets as many back, forward and backward: the plan's
  all-to-all bytes over fsdp, against the padded buckets' n x min(K, E_local)
  / K times that."""
  cfg = micro_config(**RAGGED, **{"mesh.data": 1, "mesh.fsdp": 8})
  layers, n, t, k, d = 2, 8, 2 * cfg.seq_len, 2, cfg.model.embed_dim
  report = plan(cfg, 8, False)
  planned = {(c["kind"], c["axis"]): c["bytes"] for c in report["collectives"]}
  rows = 4 * layers * t * k * d * 4 * (n - 1) / n  # float32 rows: forward, back, and transposes
  counts = layers * 4 * n * (1 + 1) * (n - 1) / n  # each forward's counts and starts (int32)
  offsets = 2 * layers * 4 * n * 2 * (n - 1) / n  # the transposes' offsets (int32)
  assert planned["all-to-all", "fsdp"] == pytest.approx(rows + counts + offsets)
  padded = micro_config(**MOE, **{"mesh.data": 1, "mesh.fsdp": 8})
  padded_report = plan(padded, 8, False)
  padded_bytes = {(c["kind"], c["axis"]): c["bytes"]
                  for c in padded_report["collectives"]}["all-to-all", "fsdp"]
  assert padded_bytes > 3.5 * planned["all-to-all", "fsdp"]  # n x min(K, E_local) / K = 4
  assert "balanced routing" in format_plan(report)
  assert "balanced routing" not in format_plan(padded_report)
