"""A run resolved once from its config and devices (`meshtrain.train.run`):
what it derives, what it checks where, and that the step is built from it."""

import pytest

from conftest import micro_config
from meshtrain import validate
from meshtrain.errors import ConfigError
from meshtrain.parallel.pipeline.stages import StageLayout
from meshtrain.planner.plan import abstract_mesh
from meshtrain.train.parallelize import Execution
from meshtrain.train.run import resolve
from meshtrain.train.setup import build

MOE = {"model.moe.num_experts": 4, "model.moe.experts_per_token": 2, "model.moe.mlp_dim": 32}


def test_a_run_holds_each_derived_choice_and_the_step_is_built_from_them():
  """An uneven pipeline with experts split over fsdp: the layout the config's
  `stage_layers` names, the experts' axes, the execution this CPU runs
  ("" attention and "auto" GEMM resolved), and the step's own mesh and rules."""
  cfg = micro_config(**MOE, **{"model.num_layers": 3, "mesh.fsdp": 2, "mesh.data": 2,
                               "mesh.pipeline": 2, "pipeline.stage_layers": "1,2",
                               "pipeline.microbatches": 2, "expert_parallel": "fsdp",
                               "model.moe.first_dense_layers": 0})
  setup = build(cfg)
  run = setup.run
  assert run.layout == StageLayout((1, 2), num_stages=2) and run.pipelined
  assert run.expert_axes == ("fsdp",)
  assert run.execution == Execution(attention="xla", grouped_gemm="tiled", dispatch="padded")
  assert run.model.moe.num_experts == 4 and run.model.num_layers == 3
  assert setup.mesh is run.mesh and setup.rules is run.rules
  assert setup.train_step.mesh is run.mesh and setup.train_step.rules is run.rules


def test_checks_that_need_devices_wait_for_them():
  """Ragged dispatch between devices: planned on abstract devices, refused
  on this machine's CPUs (XLA:CPU cannot compile it), one line naming the key."""
  cfg = micro_config(**MOE, **{"mesh.fsdp": 2, "mesh.data": 4, "expert_parallel": "fsdp",
                               "experts.dispatch": "ragged"})
  assert resolve(cfg, abstract_mesh(cfg.mesh, 8)).execution.dispatch == "ragged"
  with pytest.raises(ConfigError, match=r"^config\.experts\.dispatch: ragged: XLA:CPU"):
    resolve(cfg)


@pytest.mark.parametrize("changes, key", [
    # float16 loss scaling is not wired into the pipeline (train/precision.py)
    ({"param_dtype": "float16", "compute_dtype": "float16", "mesh.data": 4, "mesh.pipeline": 2,
      "pipeline.microbatches": 2}, "config.param_dtype"),
    # local SGD keeps a whole model per data replica (train/local_sgd.py)
    ({"local_sgd.inner_steps": 2, "zero_stage": 1, "mesh.data": 8}, "config.zero_stage"),
    # ZB-V's tables are built, its V placement not yet run (docs/pipeline.md)
    ({"mesh.data": 4, "mesh.pipeline": 2, "pipeline.schedule": "zb_v",
      "pipeline.virtual_stages": 2, "pipeline.microbatches": 2, "model.num_layers": 4},
     "config.pipeline.schedule"),
])
def test_the_command_line_check_runs_the_resolution_before_any_device(changes, key):
  """`validate.check_devices` (every command, before jax sees a device)
  refuses what the resolution refuses, as the step builder would."""
  cfg = micro_config(**changes)
  for check in (lambda: validate.check_devices(cfg, 8), lambda: build(cfg)):
    with pytest.raises(ConfigError, match=rf"^{key}: "):
      check()
