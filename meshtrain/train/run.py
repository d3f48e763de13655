"""A run resolved once from its config and its devices.

`resolve(cfg, devices)` makes every choice a run derives from its config, and
runs every check of the config against the mesh, before anything is built:
`data.packing` "auto" and a corpus' vocabulary padded for `mesh.tensor`; the
mesh; the rules tables; the pipeline's stage layout; the experts' axes; the
model's definition (`LlamaConfig`, what a checkpoint holds); how it runs on
those devices (`Execution`: kernels, dispatch). The step builder
(`meshtrain.train.setup.build`), the loop, evaluation, resumption and the
planner read these from the `Run` instead of deriving them again.
"""

import dataclasses
from collections.abc import Sequence

import jax
from jax.sharding import AbstractMesh, Mesh

from meshtrain import rules as r
from meshtrain.data import packing as data_packing
from meshtrain.mesh import make_mesh
from meshtrain.models.llama import LlamaConfig
from meshtrain.parallel.pipeline.stages import StageLayout
from meshtrain.train import local_sgd, mesh_checks, parallelize, precision
from meshtrain.train.parallelize import Execution


@dataclasses.dataclass(frozen=True)
class Run:
  """What a run is, once resolved.

  Attributes:
    cfg: the config as the run uses it (`data.packing` and a corpus'
      vocabulary resolved).
    mesh: a `Mesh` of the run's devices, or an `AbstractMesh` of sizes alone
      (a plan of any config on any device count).
    rules: the rules tables of `cfg`'s strategies on `mesh`.
    layout: how the pipeline's stages hold the stacked layers.
    expert_axes: the mesh axes that split the experts.
    model: the model's definition.
    execution: how the model runs on `mesh`'s devices.
  """
  cfg: object
  mesh: Mesh | AbstractMesh
  rules: r.ShardingRules
  layout: StageLayout
  expert_axes: tuple[str, ...]
  model: LlamaConfig
  execution: Execution

  @property
  def pipelined(self) -> bool:
    return self.mesh.shape["pipeline"] > 1


def padded_vocab(cfg, tensor: int):
  """The config with `model.vocab_size` rounded up to a multiple of `tensor`
  (the mesh's) where the data's ids are fewer than the vocabulary (a prepared
  corpus, byte-level text): the extra rows are padding, never a target, and
  `vocab` splits evenly. A synthetic task's vocabulary is the task: as given."""
  if cfg.data.source not in ("tokens", "text") or not cfg.model.vocab_size % tensor:
    return cfg
  cfg = cfg.copy_and_resolve_references()
  cfg.model.vocab_size = -(-cfg.model.vocab_size // tensor) * tensor
  return cfg


def with_packing(cfg):
  """The config with `data.packing` "auto" resolved (`meshtrain.data.packing`):
  "segments" for a corpus with a loss mask, else "concat"."""
  resolved = data_packing(cfg.data)
  if resolved == cfg.data.packing:
    return cfg
  cfg = cfg.copy_and_resolve_references()
  cfg.data.packing = resolved
  return cfg


def sharding_rules(cfg, mesh) -> r.ShardingRules:
  return r.strategy_rules(mesh, cfg.zero_stage, tensor_sequence_parallel=cfg.tensor_sequence_parallel,
                          split_kv_heads=cfg.model.num_kv_heads % mesh.shape["tensor"] == 0,
                          expert_axes=parallelize.expert_axes(cfg))


def check(cfg, mesh: Mesh | AbstractMesh) -> None:
  """Every check of `resolve` that needs no devices, each failing as one
  `ConfigError`: the config against the mesh's sizes (`mesh_checks.check`),
  local SGD's and precision's. The planner's search runs it on each
  candidate's config, so that it ranks only what meshtrain runs."""
  mesh_checks.check(cfg, mesh)
  local_sgd.validate(cfg)
  precision.validate(cfg)


def resolve(cfg, devices: Sequence[jax.Device] | AbstractMesh | None = None) -> Run:
  """The run of `cfg` on `devices` (default: this machine's; a GPU target's
  compile for that cluster, `meshtrain.gpu_targets`), each check failing as
  one `ConfigError`. Given an `AbstractMesh` (sizes alone, as `meshtrain
  plan` plans any config on any device count) the checks that need devices
  are left out and the execution is this machine's."""
  mesh = (devices if isinstance(devices, AbstractMesh)
          else make_mesh(cfg.mesh, devices if devices is not None else jax.devices()))
  cfg = with_packing(padded_vocab(cfg, mesh.shape["tensor"]))
  check(cfg, mesh)
  if isinstance(mesh, Mesh):
    mesh_checks.check_machine(cfg, mesh)
  return Run(cfg, mesh, sharding_rules(cfg, mesh), parallelize.stage_layout(cfg),
             parallelize.expert_axes(cfg), parallelize.model_config(cfg),
             parallelize.execution_for(cfg, parallelize.run_device(mesh)))
