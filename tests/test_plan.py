"""The analytic model of `meshtrain plan` against what a real step moves.

The measurement is one profiled step (`op_trace`, beside the tests): the ops that
ran, so a pipeline's conditional ticks count only the branches taken. ZeRO and
FSDP are checked in test_zero.py from the static counts, which are exact there.
"""

import collections
import math
import re

import jax
import pytest

import op_trace
from conftest import USERS_CPU_COMPILE, micro_config, step_collectives, tiered
from meshtrain.analysis import hlo
from meshtrain.planner.plan import (abstract_mesh, activation_bytes, analytic, compile_step,
                                     split_bytes, stage_layers)
from meshtrain.data import make_iterator
from meshtrain.train.loop import to_global
from meshtrain.train.parallelize import llama_spec, model_config
from meshtrain.train.run import sharding_rules
from meshtrain.train.setup import build
from meshtrain.train.state_memory import stacked_slots

STRATEGIES = {
    "tp": dict(mesh=dict(data=2, tensor=4)),
    "tp+sp": dict(mesh=dict(data=2, tensor=4), tensor_sequence_parallel=True),
    "tp+sp full remat": dict(mesh=dict(data=2, tensor=4), tensor_sequence_parallel=True,
                             remat="full"),
    **{f"cp {s}": dict(mesh=dict(data=2, sequence=4), attention=dict(sequence_strategy=s))
       for s in ("all_gather_kv", "ulysses", "ring")},
    "1f1b": dict(mesh=dict(data=4, pipeline=2), pipeline=dict(microbatches=2)),
    "gpipe": dict(mesh=dict(data=4, pipeline=2), pipeline=dict(schedule="gpipe", microbatches=4)),
    "3d": dict(mesh=dict(data=2, pipeline=2, tensor=2), tensor_sequence_parallel=True,
               pipeline=dict(microbatches=2)),
}


def by_axis(collectives) -> collections.Counter:
  """Bytes over each of the axes activations move on (and the gradient sums
  over the length axes: `test_gradients_are_summed_over_the_length_axes_first`).
  The sums over the batch axes are checked in test_zero.py."""
  totals = collections.Counter()
  for c in collectives:
    if c["axis"] in ("tensor", "sequence", "pipeline"):
      totals[c["axis"]] += c["bytes"]
  return totals


def executed_collectives(setup) -> list[dict]:
  cfg = setup.cfg
  state = setup.init_state()
  batch = to_global(next(make_iterator(cfg.data, seq_len=cfg.seq_len, global_batch=cfg.global_batch,
                                       vocab_size=cfg.model.vocab_size, seed=0)),
                    setup.train_step.batch_sharding)
  compiled = setup.train_step.lower(state, batch).compile()
  state, metrics = setup.train_step(state, batch)
  jax.block_until_ready(metrics)
  executed = op_trace.executions(lambda: setup.train_step(state, batch), compiled, setup.mesh.size)
  return [vars(c) for c in hlo.collectives(compiled, setup.mesh, executed)]


@pytest.mark.parametrize("strategy", tiered(STRATEGIES, ("tp+sp", "1f1b")))
def test_activation_traffic_matches_the_analytic_model(strategy):
  cfg = micro_config(**{"model.num_kv_heads": 4})  # kv heads split like the query heads
  cfg.update(STRATEGIES[strategy])  # nested dicts update sub-configs key by key
  setup = build(cfg)
  measured = by_axis(executed_collectives(setup))
  predicted = by_axis(analytic(cfg, setup.spec, setup.rules, setup.mesh)["collectives"])
  assert set(measured) == set(predicted) != set()
  for axis in measured:
    assert measured[axis] == pytest.approx(predicted[axis], rel=0.10), axis


@pytest.mark.parametrize("strategy, length_axis",
                         [pytest.param("tp+sp", "tensor", id="tp+sp"),
                          pytest.param("cp ring", "sequence", id="cp ring",
                                       marks=pytest.mark.slow)])
def test_gradients_are_summed_over_the_length_axes_first(strategy, length_axis):
  """A weight the length axis does not split (norm scales; under `sequence`
  every weight) has a gradient partial over the tokens of the length axis and
  of `data`. XLA completes the length axis's sum inside the layer that makes
  it and `data`'s with the other gradients: two all-reduces, as plan counts
  them, not one over both axes (it counted 1,120 bytes over `data+tensor`
  that no op moves)."""
  cfg = micro_config(**{"model.num_kv_heads": 4, "model.vocab_size": 512})
  cfg.update(STRATEGIES[strategy])
  setup = build(cfg)
  measured = step_collectives(compile_step(setup), setup.mesh)
  planned = {c["axis"]: c["bytes"] for c in analytic(cfg, setup.spec, setup.rules, setup.mesh)[
      "collectives"] if c["kind"] == "all-reduce"}
  assert set(planned) == {"data", length_axis}
  assert {axis for kind, axis in measured if kind == "all-reduce"} == set(planned)
  for axis, planned_bytes in planned.items():  # + the metrics' scalars
    assert planned_bytes <= measured["all-reduce", axis]["bytes"] <= 1.07 * planned_bytes, axis


@pytest.mark.parametrize("mesh", [
    dict(data=1, fsdp=8),
    pytest.param(dict(data=1, fsdp=4, sequence=2), marks=pytest.mark.slow)],
    ids=["fsdp=8", "fsdp=4 x sequence=2"])
def test_a_tied_tables_gradient_is_reduce_scattered_once(mesh):
  """The table tied to the head gets two gradients, the lookup's and the
  head's: summed into the table's own layout they are reduce-scattered once
  over `fsdp`, as plan counts them. Left in the compute layout, XLA
  all-reduced each whole over `fsdp` (230,713 bytes where plan counts
  1,120, and 71,680 of the 129,024 reduce-scattered on fsdp=8). The lookup's
  rows may move by an all-to-all, a token's width each, which plan leaves out."""
  cfg = micro_config(**{"model.num_kv_heads": 4, "model.vocab_size": 512,
                        "model.tie_embeddings": True, **{f"mesh.{a}": n for a, n in mesh.items()}})
  setup = build(cfg)
  measured = step_collectives(compile_step(setup), setup.mesh)
  planned = {(c["kind"], c["axis"]): c["bytes"]
             for c in analytic(cfg, setup.spec, setup.rules, setup.mesh)["collectives"]}
  assert measured["reduce-scatter", "fsdp"]["bytes"] == planned["reduce-scatter", "fsdp"]
  # + the metrics' scalars
  assert measured["all-reduce", "fsdp"]["bytes"] <= 1.25 * planned["all-reduce", "fsdp"]
  tokens = cfg.global_batch * cfg.seq_len // mesh["fsdp"]  # a device's, over its whole length
  assert measured["all-to-all", "fsdp"]["bytes"] <= 4 * tokens * cfg.model.embed_dim


@pytest.mark.parametrize("microbatches", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_fsdp_inside_a_pipeline_moves_its_weights_every_microbatch(microbatches):
  """Inside the pipeline `fsdp` stays automatic and the layers run tick by
  tick: a profiled step gathers the layer weights and reduce-scatters their
  gradients once per microbatch, and so does the analytic model (it counted
  them once per step, a step's bytes whatever the microbatches)."""
  cfg = micro_config(**{"mesh.data": 1, "mesh.fsdp": 4, "mesh.pipeline": 2, "global_batch": 16,
                        "pipeline.microbatches": microbatches})
  setup = build(cfg)
  measured = {(c["kind"], c["axis"]): c["bytes"] for c in executed_collectives(setup)}
  predicted = {(c["kind"], c["axis"]): c["bytes"]
               for c in analytic(cfg, setup.spec, setup.rules, setup.mesh)["collectives"]}
  for key in (("all-gather", "fsdp"), ("reduce-scatter", "fsdp")):
    assert predicted[key] == pytest.approx(measured[key], rel=0.10), key


def test_flash_attention_stores_no_scores():
  """XLA's attention keeps the [batch, heads, length, length] scores for the
  backward (at least one float32 copy per layer); cuDNN's flash attention none."""
  xla, cudnn = (micro_config(**{"attention.implementation": impl}) for impl in ("xla", "cudnn"))
  mesh = abstract_mesh(xla.mesh, 8)
  rules = sharding_rules(xla, mesh)
  m = xla.model
  per_device_scores = 4 * xla.global_batch // 8 * m.num_heads * xla.seq_len**2
  dropped = activation_bytes(xla, mesh, rules) - activation_bytes(cudnn, mesh, rules)
  assert dropped >= m.num_layers * per_device_scores


def test_flash_attention_drops_the_scores_alone_when_the_width_equals_the_length():
  """A layer's [rows, length, embed] activations of a model as wide as its
  length (the 1B preset: 2,048 and 2,048) look like [length, length] scores;
  flash attention drops the same bytes as for a wider model, whose scores
  are the same."""
  def dropped(width):
    xla, cudnn = (micro_config(**{"attention.implementation": impl, "seq_len": 32,
                                  "model.embed_dim": width}) for impl in ("xla", "cudnn"))
    mesh = abstract_mesh(xla.mesh, 8)
    rules = sharding_rules(xla, mesh)
    return activation_bytes(xla, mesh, rules) - activation_bytes(cudnn, mesh, rules)
  assert dropped(32) == dropped(48) > 0


def test_zero1_and_zero2_are_one_program_without_accumulation():
  """At grad_accum_steps=1 the `grads` rules lay out nothing (no accumulator),
  so ZeRO-1 and ZeRO-2 compile to the same program, and plan gives them the
  same bytes (it gave ZeRO-2 sharded gradients that the program never has)."""
  reports, programs = {}, {}
  for stage in (1, 2):
    cfg = micro_config(**{"mesh.data": 8, "zero_stage": stage})
    setup = build(cfg)
    reports[stage] = analytic(cfg, setup.spec, setup.rules, setup.mesh)["memory_bytes"]
    programs[stage] = hlo.without_metadata(compile_step(setup).as_text())
  assert programs[1] == programs[2]
  assert reports[1] == reports[2]


def test_grad_dtype_halves_the_accumulator_in_plan_and_compiled_step():
  """bfloat16 gradients: the per-replica accumulator (data parallel with
  accumulation) takes half the bytes; the plan's drop matches the compiled one."""
  plans, temps = {}, {}
  for dtype in ("float32", "bfloat16"):
    cfg = micro_config(**{"mesh.data": 8, "grad_accum_steps": 2, "grad_dtype": dtype,
                          "model.embed_dim": 64, "model.mlp_dim": 256})
    setup = build(cfg)
    plans[dtype] = analytic(cfg, setup.spec, setup.rules, setup.mesh)["memory_bytes"]["grads"]
    temps[dtype] = hlo.memory_bytes(compile_step(setup, USERS_CPU_COMPILE))["temp"]
  assert plans["bfloat16"] * 2 == plans["float32"]
  assert temps["float32"] - temps["bfloat16"] == pytest.approx(
      plans["float32"] - plans["bfloat16"], rel=0.10)


def test_uneven_stages_hold_the_largest_chunk_and_wait_for_the_fullest_stage():
  """5 layers as 2 + 3 on 2 stages: each stage holds 3 layer slots (the
  first's last one zeros), so its weights, gradients and optimizer state are
  those of 3 layers, as are the residuals a chunk stashes; the step waits
  for the 3-layer stage, whose tensor and pipeline traffic it is. The plan
  is the even 3 + 3 of 6 layers, byte for byte and collective for collective."""
  def report(layers: int, split: str) -> dict:
    cfg = micro_config(**{"model.num_layers": layers, "mesh.data": 2, "mesh.pipeline": 2,
                          "mesh.tensor": 2, "tensor_sequence_parallel": True,
                          "pipeline.microbatches": 2, "pipeline.stage_layers": split})
    mesh = abstract_mesh(cfg.mesh, 8)
    return analytic(cfg, llama_spec(model_config(cfg)), sharding_rules(cfg, mesh), mesh)
  assert report(5, "2,3") == report(5, "3,2") == report(6, "")


def test_interleaved_uneven_stages_wait_round_by_round():
  """10 layers as 2, 3 (chunks 0 and 1, the first round) and 3, 2 (the
  second) on 2 stages: each stage runs 5 layers, but in lock step a round's
  ticks wait for its fuller stage, 3 layers each round: 6; every chunk
  holds 3 slots, 12 in all: as the even split of 12 layers, 12 / 2 and 12 / 4."""
  cfg = micro_config(**{"model.num_layers": 10, "mesh.pipeline": 2, "pipeline.virtual_stages": 2,
                        "pipeline.stage_layers": "2,3,3,2"})
  assert stage_layers(cfg) == (6, 3)
  assert stacked_slots(cfg) == 12
  cfg.update({"model": {"num_layers": 12}, "pipeline": {"stage_layers": ""}})
  assert stage_layers(cfg) == (6, 3) and stacked_slots(cfg) is None


def tick_loop_float32_bytes(compiled) -> int:
  """Bytes of the float32 arrays the pipeline's tick loop carries (the
  compiled program's while loop with the most operands)."""
  carries = re.findall(r"%while[.0-9]* = \((.*?)\) while\(", compiled.as_text())
  return sum(4 * math.prod(int(n) for n in shape.split(",") if n)
             for shape in re.findall(r"f32\[([0-9,]*)\]", max(carries, key=len)))


@pytest.mark.parametrize("mesh", [dict(data=2, fsdp=2), dict(data=1, fsdp=4)],
                         ids=["data=2", "data=1"])
def test_pipeline_gradient_sums_are_what_the_tick_loop_carries(mesh):
  """A pipeline stage sums its gradients in float32 in the tick loop and
  reduces them over `data` after it: the sums are the stage's weights split
  over `fsdp` as the weights are, whatever `data` is (not split over `data`,
  whose reduction comes after the loop). bfloat16 weights and activations,
  weights larger than activations: the loop's float32 carry is the sums and
  little else."""
  cfg = micro_config(**{"mesh.data": mesh["data"], "mesh.fsdp": mesh["fsdp"], "mesh.pipeline": 2,
                        "zero_stage": 1, "pipeline.microbatches": 2, "global_batch": 8,
                        "model.embed_dim": 256, "model.mlp_dim": 2048, "model.num_kv_heads": 4,
                        "model.head_dim": 64, "param_dtype": "bfloat16",
                        "compute_dtype": "bfloat16"})
  setup = build(cfg)
  planned = analytic(cfg, setup.spec, setup.rules, setup.mesh, activations=0)["memory_bytes"]
  carried = tick_loop_float32_bytes(compile_step(setup))
  assert carried == pytest.approx(planned["grads"], rel=0.10)
  params = setup.spec.abstract_params  # every stage sums the embedding's and the head's too
  layers = sum(x.size for x in jax.tree.leaves(params["layers"]))
  stage = sum(x.size for x in jax.tree.leaves(params)) - layers + layers / cfg.mesh.pipeline
  assert carried == pytest.approx(4 * stage / mesh["fsdp"], rel=0.10)


def test_a_pipelines_cut_is_each_weight_matmuls_input_and_output_gradient():
  """What B leaves W per layer and microbatch (`plan.split_bytes`), counted by
  hand for the micro model under full recomputation on data=2 x tensor=2 x
  pipeline=2 (float32): each weight matmul's input and output gradient, the
  attention's heads and the MLP split over `tensor`, and the two norms'
  scale gradients; F's stash is the layer's input."""
  cfg = micro_config(**{"mesh.data": 2, "mesh.tensor": 2, "mesh.pipeline": 2, "remat": "full",
                        "pipeline.microbatches": 2})
  mesh = abstract_mesh(cfg.mesh, 8)
  d, local_heads, local_kv, h, local_f = 32, 2, 1, 8, 32
  per_token = (d + (local_heads + 2 * local_kv) * h    # q, k, v from the normed input
               + local_heads * h + d                   # the output projection
               + d + 2 * local_f + 2 * local_f         # gate and up: input, outputs, gradients
               + d)                                    # the down projection's output gradient
  tokens = cfg.global_batch // cfg.pipeline.microbatches // cfg.mesh.data * cfg.seq_len
  held = split_bytes(cfg, mesh, sharding_rules(cfg, mesh), cfg.global_batch // 2)
  assert held["cut"] == 4 * (tokens * per_token + 2 * d)
  assert held["res"] == 4 * tokens * d
