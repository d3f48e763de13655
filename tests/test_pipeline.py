"""Pipeline parallelism in the train step: config errors, what the compiled step
moves between stages, and the 1F1B memory profile. Equality with unsharded
training is in test_train_equivalence.py, the executor alone in
test_pipeline_runtime.py, the schedule tables in test_schedule.py."""

import collections
import functools

import pytest

import compiled_flops
from conftest import micro_config
from meshtrain.analysis import hlo
from meshtrain.errors import ConfigError
from meshtrain.parallel.pipeline import runtime, schedule as schedules
from meshtrain.planner.plan import compile_step
from meshtrain.train.setup import build


def pipeline_config(microbatches=4, schedule="1f1b", **changes):
  cfg = micro_config()
  cfg.mesh.update(data=4, pipeline=2)
  cfg.pipeline.update(schedule=schedule, microbatches=microbatches)
  cfg.global_batch = 4 * 2 * microbatches  # 2 sequences per device and microbatch
  cfg.update(changes)  # nested dicts update sub-configs key by key
  return cfg


@pytest.mark.parametrize("changes, key", [
    (dict(model=dict(num_layers=3)), "config.model.num_layers"),
    (dict(mesh=dict(data=2, pipeline=4), schedule="interleaved_1f1b",
          pipeline=dict(virtual_stages=2), model=dict(num_layers=8), microbatches=2),
     "config.pipeline.microbatches"),
    (dict(global_batch=12), "config.pipeline.microbatches"),
    (dict(grad_accum_steps=4), "config.pipeline.microbatches"),
    (dict(mesh=dict(data=2, sequence=2), attention=dict(sequence_strategy="ring")),
     "config.attention.sequence_strategy"),
    (dict(offload=dict(params=True)), "config.offload.params"),
    (dict(remat="offload"), "config.remat"),
    (dict(pipeline=dict(virtual_stages=2), model=dict(num_layers=4)),
     "config.pipeline.virtual_stages"),  # 1f1b runs one chunk per stage
])
def test_impossible_pipelines_name_the_key(changes, key):
  with pytest.raises(ConfigError) as error:
    build(pipeline_config(**changes))
  assert error.value.key == key


def test_interleaved_with_too_few_microbatches_names_the_config_keys():
  cfg = pipeline_config(6, "interleaved_1f1b", mesh=dict(data=2, pipeline=4),
                        pipeline=dict(virtual_stages=2), model=dict(num_layers=8))
  with pytest.raises(ConfigError, match=r"config\.pipeline\.microbatches to be a multiple of "
                     r"config\.mesh\.pipeline=4.*use 8 or config\.pipeline\.virtual_stages=1"):
    build(cfg)


def test_stages_exchange_activations_by_permutes_and_reduce_data_once():
  setup = build(pipeline_config())
  ops = hlo.collective_ops(compile_step(setup), setup.mesh)
  over = collections.defaultdict(set)
  for op in ops:
    over[op.axis, op.in_loop].add(op.kind)
  assert over["pipeline", True] == {"collective-permute"}
  assert not any("pipeline" in op.axis and op.kind == "all-gather" for op in ops)
  assert not any("data" in axis and in_loop for axis, in_loop in over)  # once, after the ticks


def temp_bytes(schedule, microbatches):
  setup = build(pipeline_config(microbatches, schedule))
  return hlo.memory_bytes(compile_step(setup))["temp"]


@pytest.mark.slow
def test_1f1b_memory_is_flat_in_microbatches_and_gpipe_grows():
  one_f_one_b = {m: temp_bytes("1f1b", m) for m in (4, 32)}
  gpipe = {m: temp_bytes("gpipe", m) for m in (4, 32)}
  assert one_f_one_b[32] <= 1.10 * one_f_one_b[4], one_f_one_b
  # GPipe keeps every microbatch's activations: 28 more cost far more than 1F1B's stash.
  assert gpipe[32] - gpipe[4] > 10 * (one_f_one_b[32] - one_f_one_b[4]), (gpipe, one_f_one_b)


@functools.cache
def plain_step_flops(num_layers, remat):
  """The unpipelined step of the same model and global batch, on data=8."""
  cfg = micro_config()
  cfg.update(dict(mesh=dict(data=8), model=dict(num_layers=num_layers), remat=remat,
                  global_batch=4 * 2 * 2))
  return compiled_flops.dot_flops(compile_step(build(cfg)))


@pytest.mark.parametrize("schedule, remat", [
    pytest.param("gpipe", "none", marks=pytest.mark.slow), ("1f1b", "none"),
    pytest.param("interleaved_1f1b", "none", marks=pytest.mark.slow),
    pytest.param("1f1b", "full", marks=pytest.mark.slow)])
def test_pipelined_step_does_the_unpipelined_matmul_flops(schedule, remat):
  """Read from the compiled steps (loops times their trips, the tick switch
  weighted by how often the table runs each branch): B consumes F's stashed
  residuals and W uses B's cut, so nothing is recomputed beyond what `remat`
  asks of the unpipelined step too. Both run on 8 devices."""
  virtual = 2 if schedule == "interleaved_1f1b" else 1
  layers = 2 * virtual
  setup = build(pipeline_config(2, schedule, remat=remat, model=dict(num_layers=layers),
                                pipeline=dict(virtual_stages=virtual)))
  weights = runtime.cond_weights(schedules.build(schedule, 2, 2, virtual))
  ratio = compiled_flops.dot_flops(compile_step(setup), weights) / plain_step_flops(layers, remat)
  assert 0.97 <= ratio <= 1.03, ratio


def test_a_tick_copies_its_sends_and_arrivals_and_nothing_of_the_stashes():
  """Read from the compiled step: the buffers a tick carries (every slot of
  every stash, the gradient sums) are updated where they lie. What XLA still
  copies in a tick is bounded by the schedule's per-tick values: the
  activation and the gradient arriving into their slots, F's and B's
  outputs into the send buffers, and the layer loop's carry (one activation
  per layer, as in the unpipelined step) in F and in B. A switch over the
  ops that passed every buffer through copied them all, each tick (133
  activations here)."""
  cfg = pipeline_config(4, "1f1b", model=dict(num_layers=4))
  per_tick = hlo.loop_copy_bytes(compile_step(build(cfg)))
  rows = cfg.global_batch // cfg.pipeline.microbatches // cfg.mesh.data  # per device
  activation = rows * cfg.seq_len * cfg.model.embed_dim * 4
  layers_per_chunk = cfg.model.num_layers // cfg.mesh.pipeline
  assert per_tick <= (4 + 2 * layers_per_chunk) * activation * 1.01, (per_tick, activation)
