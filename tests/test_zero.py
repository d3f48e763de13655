"""ZeRO stages and FSDP: what the compiled step contains, and what it holds in memory.

Equality with unsharded training is in test_train_equivalence.py.
"""

import collections
import importlib.util
import json
import subprocess
import sys

import pytest

from conftest import REPO, micro_config, tiered
from meshtrain.planner.plan import plan


def load_config(name):
  module_spec = importlib.util.spec_from_file_location(name, REPO / "configs" / f"{name}.py")
  module = importlib.util.module_from_spec(module_spec)
  module_spec.loader.exec_module(module)
  return module.get_config()


def compiled_plan(cfg, **changes):
  cfg.update(changes)  # nested dicts update sub-configs key by key
  return plan(cfg, 8, compile_step=True)


def by_kind(collectives, in_loop=None):
  totals = collections.Counter()
  for c in collectives:
    if in_loop is None or c.get("in_loop") == in_loop:
      totals[(c["kind"], c["axis"])] += c["bytes"]
  return totals


STAGES = {
    "zero0": dict(mesh=dict(data=8), zero_stage=0),
    "zero1": dict(mesh=dict(data=8), zero_stage=1),
    "zero2 accumulate 2": dict(mesh=dict(data=8), zero_stage=2, grad_accum_steps=2),
    "zero3": dict(mesh=dict(data=8), zero_stage=3),
    "fsdp=8": dict(mesh=dict(data=1, fsdp=8)),
    "data=2 fsdp=4 accumulate 2": dict(mesh=dict(data=2, fsdp=4), grad_accum_steps=2),
}
# What each stage must produce over each mesh axis ("in loop": inside the layer scan).
EXPECTED = {
    "zero0": {("all-reduce", "data")},
    "zero1": {("reduce-scatter", "data"), ("all-gather", "data")},
    "zero2 accumulate 2": {("reduce-scatter", "data"), ("all-gather", "data")},
    "zero3": {("reduce-scatter", "data"), ("all-gather", "data")},
    "fsdp=8": {("reduce-scatter", "fsdp"), ("all-gather", "fsdp")},
    "data=2 fsdp=4 accumulate 2": {("reduce-scatter", "fsdp"), ("all-gather", "fsdp"),
                                   ("all-reduce", "data")},
}
GATHERED_PER_LAYER = {"zero3": "data", "fsdp=8": "fsdp", "data=2 fsdp=4 accumulate 2": "fsdp"}


@pytest.mark.parametrize("stage", tiered(STAGES, ("zero1", "zero3", "fsdp=8")))
def test_compiled_collectives_match_the_stage_and_the_analytic_model(stage):
  report = compiled_plan(micro_config(), **STAGES[stage])
  measured = by_kind(report["measured"]["collectives"])
  analytic = by_kind(report["analytic"]["collectives"])
  large = {key for key, nbytes in measured.items() if nbytes > 0.05 * sum(measured.values())}
  assert large == EXPECTED[stage]
  for key in EXPECTED[stage]:
    assert measured[key] == pytest.approx(analytic[key], rel=0.10), key
  if stage in GATHERED_PER_LAYER:  # FSDP gathers layer by layer inside the scan
    in_loop = by_kind(report["measured"]["collectives"], in_loop=True)
    assert in_loop[("all-gather", GATHERED_PER_LAYER[stage])] > 0.8 * measured[
        ("all-gather", GATHERED_PER_LAYER[stage])]
  else:  # weights are gathered once per step, outside the loops
    in_loop = by_kind(report["measured"]["collectives"], in_loop=True)
    assert in_loop[("all-gather", "data")] <= 0.05 * measured[("all-gather", "data")]


def test_zero0_with_accumulation_reduces_gradients_once_per_step():
  report = compiled_plan(micro_config(), mesh=dict(data=8), grad_accum_steps=2)
  (all_reduce,) = [c for c in report["measured"]["collectives"] if c["kind"] == "all-reduce"
                   and c["bytes"] > 1000]
  assert not all_reduce["in_loop"] and all_reduce["count"] == 1


@pytest.mark.slow
def test_fsdp_holds_an_eighth_of_the_state_on_the_small_config():
  dp = compiled_plan(load_config("small"), mesh=dict(data=8), zero_stage=0)
  fsdp = compiled_plan(load_config("small"), mesh=dict(data=1, fsdp=8))
  zero1 = compiled_plan(load_config("small"), mesh=dict(data=8), zero_stage=1)
  state = lambda report: report["measured"]["memory_bytes"]["arguments"]
  assert state(fsdp) <= 1.15 * state(dp) / 8
  assert state(zero1) <= 1.15 * state(dp) / 8  # master weights and Adam moments sharded


@pytest.mark.slow
def test_plan_cli_plans_8b_on_1024_devices_without_devices(tmp_path):
  result = subprocess.run(
      [sys.executable, "-m", "meshtrain.cli", "plan", "--config", str(REPO / "configs/llama_8b.py"),
       "--config.mesh.data=16", "--config.mesh.fsdp=64", "--config.global_batch=1024",
       "--devices=1024", "--json"], capture_output=True, text=True, timeout=300, cwd=tmp_path)
  assert result.returncode == 0, result.stderr
  report = json.loads(result.stdout)
  memory = report["analytic"]["memory_bytes"]
  assert set(memory) == {"params", "grads", "optimizer", "activations", "backward", "total"}
  # Fully sharded over fsdp=64: bf16 working weights (2 bytes), float32 gradients (4),
  # float32 master weights, m and v (12), each divided by 64.
  state = memory["params"] + memory["grads"] + memory["optimizer"]
  assert state == pytest.approx(report["parameters"] * (2 + 4 + 12) / 64, rel=0.01)  # norms whole
  assert {"kind", "axis", "count", "bytes"} <= set(report["collectives"][0])
