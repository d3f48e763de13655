"""A saved state's layer stacks moved into the stage layout of the run that reads it.

An uneven pipeline stores the layers in its stage layout's slots
(`parallelize.in_stage_slots`), so the layer stacks of a checkpoint (the
weights, the optimizer's moments of them, the MoE biases) have the shape of
the layout that saved it. A run on another layout (other stage layers,
another pipeline or none) reads them at their saved shape, whole over the
layer axis (each device holds every layer of its shards while they move),
and moves them: out of the saved slots into the model's layers, into its own.
"""

import dataclasses
from collections.abc import Callable
from pathlib import Path

import jax
import orbax.checkpoint as ocp
from jax.sharding import NamedSharding, PartitionSpec

from meshtrain import workdir as saved_run
from meshtrain.config import from_saved
from meshtrain.errors import reading
from meshtrain.parallel.pipeline.stages import StageLayout
from meshtrain.train.parallelize import stage_layout
from meshtrain.train.setup import Setup


def saved_layout(saved_config: dict) -> StageLayout:
  """The stage layout of a run saved with `saved_config` (its keys over the
  defaults, as `workdir.load_config` reads it)."""
  return stage_layout(from_saved(saved_config))


def _is_stack(path, x, length: int) -> bool:
  """Whether `x` is a layer stack of `length` layers or slots: under a
  `layers` key (the weights, their optimizer moments, the model state) and
  that long (not a placeholder an optimizer keeps for a weight it does not
  factor)."""
  return (any(isinstance(key, jax.tree_util.DictKey) and key.key == "layers" for key in path)
          and bool(x.shape) and x.shape[0] == length)


@dataclasses.dataclass(frozen=True)
class Relayout:
  """From the layout a state was saved in to this run's."""
  saved: StageLayout
  own: StageLayout

  @property
  def needed(self) -> bool:
    return not self.saved.stores_like(self.own)

  @staticmethod
  def _length(layout: StageLayout) -> int:
    return len(layout.counts) * layout.slots

  def as_saved(self, abstract, shardings):
    """(abstract, shardings) to read a tree saved in the saved layout: its
    layer stacks at their saved length, whole over the layer axis."""
    if not self.needed:
      return abstract, shardings
    own, saved = self._length(self.own), self._length(self.saved)

    def shape(path, x):
      return jax.ShapeDtypeStruct((saved, *x.shape[1:]), x.dtype) if _is_stack(path, x, own) else x

    def sharding(path, x, s):
      if not _is_stack(path, x, own):
        return s
      return NamedSharding(s.mesh, PartitionSpec(None, *s.spec[1:]), memory_kind=s.memory_kind)
    return (jax.tree_util.tree_map_with_path(shape, abstract),
            jax.tree_util.tree_map_with_path(sharding, abstract, shardings))

  def moved(self, tree, shardings):
    """`tree` (read by `as_saved`) in this run's layout, laid out by `shardings`."""
    if not self.needed:
      return tree

    saved = self._length(self.saved)

    def move(path, x):
      return (self.own.to_slots(self.saved.from_slots(x)) if _is_stack(path, x, saved) else x)
    return jax.jit(lambda t: jax.tree_util.tree_map_with_path(move, t),
                   out_shardings=shardings)(tree)


def _step_config(workdir, step: int) -> dict:
  """The config checkpoint `step` of `workdir` was saved with."""
  path = Path(workdir).absolute() / "checkpoints" / str(step) / "config"
  with reading("--workdir", path), ocp.Checkpointer(ocp.JsonCheckpointHandler()) as checkpointer:
    return checkpointer.restore(path)


def read_weights(workdir, step: int, setup: Setup, param_shardings=None) -> tuple:
  """The weights and the model state (None for a model without one) of
  checkpoint `step` of `workdir`, whatever stage layout saved it, in the
  layout of `setup`'s run, laid out by `param_shardings` (default: the train
  state's)."""
  relayout = Relayout(saved_layout(_step_config(workdir, step)), setup.run.layout)

  def read(load: Callable, abstract, shardings):
    tree = load(workdir, step, *relayout.as_saved(abstract, shardings))
    return None if tree is None else relayout.moved(tree, shardings)
  return (read(saved_run.load_params, setup.spec.abstract_params,
               param_shardings or setup.shardings.params),
          read(saved_run.load_model_state, jax.eval_shape(setup.spec.init_model_state),
               setup.shardings.model_state))
