"""Local SGD / DiLoCo over `data`, checked against plain optax under `jax.jit`:
H=1 with inner SGD and outer SGD at learning rate 1 is data-parallel SGD; with
AdamW inside and Nesterov outside it equals DiLoCo written out here, one
unsharded replica at a time; the inner step holds no `data` collective."""

import json

import chex
import jax
import numpy as np
import optax
import pytest

from conftest import REPO, micro_config, micro_flags
from reference import random_batches, reference_run
from meshtrain import cli
from meshtrain.analysis import hlo
from meshtrain.errors import ConfigError
from meshtrain.planner.plan import compile_step, plan
from meshtrain.train import local_sgd
from meshtrain.train.loop import train
from meshtrain.train.parallelize import from_stage_slots
from meshtrain.train.setup import build


def local_config(inner_steps, **changes):
  return micro_config(**{"local_sgd.inner_steps": inner_steps, **changes})


def run(setup, batches):
  state = setup.init_state()
  initial = jax.device_get(state.outer.params)
  losses = []
  for batch in batches:
    state, metrics = setup.train_step(
        state, {k: jax.device_put(v, setup.train_step.batch_sharding) for k, v in batch.items()})
    losses.append(float(metrics["loss"]))
  return initial, np.array(losses), jax.device_get(state)


def test_one_inner_sgd_step_and_outer_sgd_at_rate_one_is_data_parallel_sgd():
  cfg = local_config(1, **{"mesh.data": 8, "optimizer.name": "sgd", "optimizer.learning_rate": 0.5,
                           "optimizer.weight_decay": 0.0, "optimizer.clip_norm": 0.0,
                           "local_sgd.outer_optimizer": "sgd", "local_sgd.outer_learning_rate": 1.0})
  setup = build(cfg)
  batches = random_batches(4, cfg.global_batch, cfg.seq_len, cfg.model.vocab_size)
  initial, losses, state = run(setup, batches)
  sgd = optax.sgd(optax.warmup_cosine_decay_schedule(0.0, 0.5, 2, cfg.steps, 0.05))
  ref_losses, ref_params = reference_run(setup.spec.graphdef, initial, sgd, batches)
  chex.assert_trees_all_close(losses, ref_losses, rtol=1e-5, atol=1e-6)
  chex.assert_trees_all_close(state.outer.params, ref_params, rtol=1e-5, atol=1e-6)
  replica_3 = jax.tree.map(lambda x: x[3], state.params)
  chex.assert_trees_all_close(replica_3, ref_params, rtol=1e-5, atol=1e-6)


def meshtrain_train(workdir, flags) -> list[dict]:
  """`meshtrain train --config configs/tiny.py FLAGS` in this process: its metrics.jsonl."""
  with pytest.raises(SystemExit) as exit_info:
    cli.run(["train", "--config", str(REPO / "configs/tiny.py"), f"--config.workdir={workdir}",
             *flags])
  assert not exit_info.value.code, exit_info.value.code
  return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_h1_outer_sgd_from_the_command_line_logs_the_data_parallel_losses(tmp_path, real_text):
  """The README's "H = 1, inner SGD and outer SGD at rate 1 is data-parallel
  SGD" as a user runs it: text data, the default warmup then cosine decay, the
  outer momentum left at its default (outer `sgd` is plain SGD; with momentum,
  as `momentum` applies it, the runs part from step 4 on, once two nonzero
  deltas have met in it)."""
  flags = micro_flags(**{"mesh.data": 8, "steps": 6, "model.vocab_size": 256,
                         "data.source": "text", "data.path": real_text,
                         "optimizer.name": "sgd", "optimizer.learning_rate": 0.5,
                         "optimizer.weight_decay": 0, "optimizer.clip_norm": 0})
  data_parallel = meshtrain_train(tmp_path / "dp", flags)
  local = meshtrain_train(tmp_path / "local", [
      *flags, "--config.local_sgd.inner_steps=1", "--config.local_sgd.outer_optimizer=sgd",
      "--config.local_sgd.outer_learning_rate=1.0"])
  assert [r["step"] for r in local] == [r["step"] for r in data_parallel] == list(range(1, 7))
  rates = [r["learning_rate"] for r in data_parallel]
  chex.assert_trees_all_close(np.array([r["learning_rate"] for r in local]), np.array(rates),
                              rtol=1e-6)
  # warmup from 0 over 2 steps, then cosine decay: not a constant rate
  assert rates[0] == 0 and rates.index(max(rates)) == 2 and rates[-1] < max(rates) / 2, rates
  chex.assert_trees_all_close(np.array([r["loss"] for r in local]),
                              np.array([r["loss"] for r in data_parallel]), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name, expected", [
    ("sgd", optax.sgd(0.7)), ("momentum", optax.sgd(0.7, momentum=0.9)),
    ("nesterov", optax.sgd(0.7, momentum=0.9, nesterov=True))])
def test_outer_optimizers_apply_the_momentum_they_name(name, expected):
  """`outer_momentum` (0.9 here) belongs to `momentum` and `nesterov`; plain
  `sgd` takes none, so at rate 1 it averages the replicas."""
  cfg = local_config(2, **{"local_sgd.outer_optimizer": name, "local_sgd.outer_momentum": 0.9,
                           "local_sgd.outer_learning_rate": 0.7}).local_sgd
  outer, params = local_sgd.outer_optimizer(cfg), np.zeros(3, np.float32)
  states = outer.init(params), expected.init(params)
  for delta in (np.array([1.0, -2.0, 0.5], np.float32), np.array([0.5, 1.0, -1.0], np.float32)):
    (got, state), (want, reference) = (opt.update(delta, st, params)
                                       for opt, st in zip((outer, expected), states))
    states = state, reference
    chex.assert_trees_all_close(got, want, rtol=1e-6)


def diloco_reference(graphdef, shared, inner, outer, batches, replicas, inner_steps,
                     model_state=None):
  """DiLoCo, one replica at a time on one device: each runs `inner_steps` steps
  of `inner` on its rows, keeping its own inner state; `outer` applies the mean
  of (shared - replica) to the shared weights. `model_state`: the model's own
  (an MoE's selection biases), held fixed."""
  outer_state = outer.init(shared)
  inner_states = [inner.init(shared) for _ in range(replicas)]
  losses = np.zeros(len(batches))
  for start in range(0, len(batches), inner_steps):
    ends = []
    for i in range(replicas):
      rows = [{k: np.split(v, replicas)[i] for k, v in b.items()}
              for b in batches[start:start + inner_steps]]
      replica_losses, params, inner_states[i] = reference_run(
          graphdef, shared, inner, rows, opt_state=inner_states[i], model_state=model_state)
      losses[start:start + inner_steps] += replica_losses / replicas
      ends.append(params)
    delta = jax.tree.map(lambda old, *new: old - sum(new) / replicas, shared, *ends)
    updates, outer_state = outer.update(delta, outer_state, shared)
    shared = optax.apply_updates(shared, updates)
  return losses, shared


# Mixture-of-Experts, the experts over `fsdp` (each replica holds them all).
MOE = {"model.moe.num_experts": 4, "model.moe.experts_per_token": 2, "model.moe.mlp_dim": 32,
       "model.moe.aux_loss_coef": 0.0}
DILOCO_CASES = [
    {"mesh.fsdp": 2, "mesh.tensor": 2},
    *({"mesh.sequence": 2, "mesh.tensor": 2, "attention.sequence_strategy": strategy}
      for strategy in ("ring", "ulysses", "all_gather_kv")),
    {"mesh.pipeline": 2, "mesh.tensor": 2, "pipeline.microbatches": 2, "grad_accum_steps": 2,
     "model.num_layers": 3, "pipeline.stage_layers": "2,1"},
    *({**MOE, "mesh.fsdp": 2, "mesh.tensor": 2, **changes}
      for changes in ({}, {"mesh.pipeline": 2, "mesh.tensor": 1}))]


@pytest.mark.parametrize("changes", [
    pytest.param(c, id=" ".join(f"{k.split('.')[-1]}={v}" for k, v in c.items()),
                 marks=pytest.mark.slow) for c in DILOCO_CASES])
def test_adamw_inside_nesterov_outside_equals_diloco_written_out(changes):
  assert_equals_diloco_written_out(changes)


def assert_equals_diloco_written_out(changes):
  """Two replicas of `changes`' mesh, two AdamW steps inside and Nesterov
  outside, against `diloco_reference`."""
  cfg = local_config(2, **{"mesh.data": 2, **changes})
  setup = build(cfg)
  batches = random_batches(4, cfg.global_batch, cfg.seq_len, cfg.model.vocab_size)
  initial, losses, state = run(setup, batches)
  outer = optax.sgd(0.7, momentum=0.9, nesterov=True)
  layout = setup.run.layout
  ref_losses, ref_params = diloco_reference(setup.spec.graphdef, from_stage_slots(layout, initial),
                                            setup.optimizer, outer, batches, replicas=2,
                                            inner_steps=2,
                                            model_state=from_stage_slots(layout, state.model_state))
  chex.assert_trees_all_close(losses, ref_losses, rtol=1e-5, atol=1e-6)
  chex.assert_trees_all_close(from_stage_slots(layout, state.outer.params), ref_params, rtol=1e-5,
                              atol=1e-3 * cfg.optimizer.learning_rate)


@pytest.mark.parametrize("changes", [
    pytest.param({"mesh.data": 8}, id="data=8"),
    pytest.param({"mesh.data": 2, "mesh.fsdp": 2, "mesh.tensor": 2}, id="fsdp+tensor",
                 marks=pytest.mark.slow),
    pytest.param({"mesh.data": 2, "mesh.tensor": 4, "tensor_sequence_parallel": True},
                 id="tensor+sp", marks=pytest.mark.slow),
    pytest.param({"mesh.data": 4, "mesh.sequence": 2, "attention.sequence_strategy": "ring"},
                 id="sequence ring", marks=pytest.mark.slow),
    pytest.param({"mesh.data": 4, "mesh.pipeline": 2, "pipeline.microbatches": 2}, id="pipeline")])
def test_inner_step_has_no_data_collective_and_sync_all_reduces_the_deltas_once(changes):
  setup = build(local_config(4, **changes))
  inner = hlo.collectives(compile_step(setup), setup.mesh)
  assert not [c for c in inner if "data" in c.axis], inner
  abstract = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                          setup.abstract_state(), setup.shardings)
  sync = hlo.collectives(setup.train_step.lower_sync(abstract).compile(), setup.mesh)
  over_data = [c for c in sync if "data" in c.axis]
  assert {(c.kind, c.axis) for c in over_data} == {("all-reduce", "data")}, sync
  # What `meshtrain plan` counts: a ring all-reduce of this device's float32 shard, per sync.
  analytic = plan(setup.cfg, 8, compile_step=False)["analytic"]["collectives"]
  assert [c for c in analytic if "data" in c["axis"]] == [
      {"kind": "all-reduce", "axis": "data", "count": 1 / 4,
       "bytes": pytest.approx(sum(c.bytes for c in over_data) / 4, rel=1e-3)}]


@pytest.mark.parametrize("changes, key", [
    ({"zero_stage": 1}, "config.zero_stage"),
    ({"local_sgd.outer_optimizer": "adam"}, "config.local_sgd.outer_optimizer"),
    ({"offload.optimizer": True}, "config.offload.optimizer"),
    ({"offload.params": True}, "config.offload.params"),
    ({"param_dtype": "float16"}, "config.param_dtype")])
def test_unsupported_settings_name_the_key(changes, key):
  with pytest.raises(ConfigError, match=f"^{key}: "):
    build(local_config(4, **changes))


@pytest.mark.slow
def test_resume_mid_cycle_gives_the_same_losses_bit_for_bit(tmp_path):
  """Saved at step 3 of syncs every 2 steps: replicas apart and the outer
  momentum set; steps 4-6 (a sync at 4, then 5 and 6 from its result) repeat."""
  def config(workdir, **changes):
    return local_config(2, **{"mesh.data": 4, "mesh.fsdp": 2, "steps": 6, "workdir": str(workdir),
                              "checkpoint.every_steps": 3, **changes})
  straight = {r["step"]: r["loss"] for r in train(config(tmp_path / "straight"))}
  resumed = train(config(tmp_path / "resumed",
                         **{"checkpoint.restore_from": str(tmp_path / "straight/checkpoints/3")}))
  assert {r["step"]: r["loss"] for r in resumed} == {s: straight[s] for s in (4, 5, 6)}
