"""The train state, the model as the step sees it, and their creation directly in shards.

Parameters live in the state as float32 master weights (a pure dict pytree);
the step casts a working copy to `param_dtype`. Both the master weights and the
optimizer state are laid out by the `optimizer` rules table and created inside
`jax.jit` with output shardings, so no device ever holds the whole model.
"""

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from meshtrain import rules as r
from meshtrain.models.patterns import Patterns, names_by_path, path_string
from meshtrain.train.precision import LossScale


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TrainState:
  step: jax.Array
  params: Any      # float32 master weights, pure dict
  opt_state: Any
  nonfinite_steps: jax.Array  # steps whose loss or gradients were not finite (update dropped)
  outer: Any = None  # local SGD: the shared weights and the outer optimizer state
  loss_scale: Any = None  # float16: precision.LossScale
  model_state: Any = None  # the model's state that is not trained (MoE router biases), pure dict


@dataclasses.dataclass(frozen=True)
class ModelSpec:
  """What the step needs of a model: its weights' shapes and logical names, a
  function that creates them, and (NNX) how to rebuild the module from them.

  A model may also hold state that is not trained (`nnx.BatchStat`: MoE
  router biases), created by `init_model_state`, which the step hands the
  loss and moves after each step by `update_model_state(state, stats)` from
  the counts the loss returns; `metrics(stats)` are logged with the loss."""
  init: Callable[[], Any]  # () -> fresh weights, a pure dict
  abstract_params: Any     # ShapeDtypeStructs
  names: Any               # tuples of logical names, same tree
  graphdef: nnx.GraphDef | None = None
  init_model_state: Callable[[], Any] = lambda: None  # () -> a pure dict, or None
  update_model_state: Callable[[Any, dict], Any] | None = None
  metrics: Callable[[dict], dict] | None = None


def nnx_spec(create: Callable[[], nnx.Module], patterns: Patterns | None = None) -> ModelSpec:
  """The spec of any flax NNX model. Logical names come from the variables'
  annotations (`nnx.with_partitioning`) or, for a model without them, from
  `patterns` (see `meshtrain.models.patterns`)."""
  def split():
    # Not eagerly: the trainer places the weights (mesh-axis annotations need no mesh here).
    with nnx.use_eager_sharding(False):
      graphdef, params, state, rest = nnx.split(create(), nnx.Param, nnx.BatchStat, ...)
    others = [path_string(path) for path, _ in jax.tree_util.tree_flatten_with_path(rest)[0]]
    if others:
      raise ValueError(f"meshtrain trains nnx.Param weights (and keeps nnx.BatchStat state); "
                       f"this model also holds {others}")
    return graphdef, params, state

  graphdef, abstract, abstract_state = nnx.eval_shape(split)
  abstract_params = abstract.to_pure_dict()
  names = r.logical_names(abstract) if patterns is None else names_by_path(abstract_params, patterns)
  has_state = bool(jax.tree.leaves(abstract_state))
  return ModelSpec(lambda: split()[1].to_pure_dict(), abstract_params, names, graphdef,
                   init_model_state=lambda: split()[2].to_pure_dict() if has_state else None)


def merged(spec: ModelSpec, params, model_state=None) -> nnx.Module:
  """The NNX module of `spec` with these weights (and model state)."""
  return nnx.merge(spec.graphdef, params, *([model_state] if model_state is not None else []))


def state_shardings(spec: ModelSpec, optimizer: optax.GradientTransformation,
                    mesh: Mesh, rules: r.ShardingRules, loss_scale: LossScale | None = None
                    ) -> TrainState:
  """NamedShardings of every leaf of the train state (`loss_scale`: its initial value, if any)."""
  master = r.tree_shardings(spec.names, mesh, rules.optimizer)
  abstract_opt = jax.eval_shape(optimizer.init, spec.abstract_params)
  replicated = NamedSharding(mesh, PartitionSpec())
  # A leaf shaped like its weight (moments) lies like it; others, such as
  # Adafactor's factored row and column statistics, are small and replicated.
  opt = optax.tree_map_params(
      optimizer, lambda leaf, param, sharding: sharding if leaf.shape == param.shape else replicated,
      abstract_opt, spec.abstract_params, master, transform_non_params=lambda _: replicated)
  return TrainState(step=replicated, params=master, opt_state=opt, nonfinite_steps=replicated,
                    loss_scale=jax.tree.map(lambda _: replicated, loss_scale),
                    model_state=jax.tree.map(lambda _: replicated,
                                             jax.eval_shape(spec.init_model_state)))


def with_memory_kind(tree: Any, memory_kind: str) -> Any:
  """The same shardings in `memory_kind` memory ("pinned_host" or "device")."""
  return jax.tree.map(lambda s: s.with_memory_kind(memory_kind), tree)


def in_memory(shardings: TrainState, memory_kind: str) -> TrainState:
  """The same layout with the master weights and optimizer state in `memory_kind`
  memory ("pinned_host": offloaded to the host between steps, or "device")."""
  return dataclasses.replace(shardings, params=with_memory_kind(shardings.params, memory_kind),
                             opt_state=with_memory_kind(shardings.opt_state, memory_kind))


def is_offloaded(shardings: TrainState) -> bool:
  return any(s.memory_kind == "pinned_host" for s in jax.tree.leaves(shardings.params))


def init_state(spec: ModelSpec, optimizer: optax.GradientTransformation,
               shardings: TrainState, loss_scale: LossScale | None = None) -> TrainState:
  """Creates parameters and optimizer state in their shards."""
  def create():
    params = spec.init()
    return TrainState(jnp.zeros((), jnp.int32), params, optimizer.init(params),
                      jnp.zeros((), jnp.int32), loss_scale=loss_scale,
                      model_state=spec.init_model_state())
  return jax.jit(create, out_shardings=shardings)()
