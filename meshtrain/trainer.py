"""meshtrain's rules and train step for a model that is not meshtrain's own.

    trainer = Trainer.for_nnx(lambda: MyModel(rngs=nnx.Rngs(0)), loss_fn, optax.adamw(1e-3),
                              make_mesh({"fsdp": 4, "tensor": 2}), patterns=FLAX_TRANSFORMER)
    state = trainer.init()                       # weights and optimizer state, in shards
    state, metrics = trainer.step(state, batch)  # {"inputs": [B, L], ...}: rows over data x fsdp

The strategy is the mesh: every axis larger than one applies its rules table
(`meshtrain.rules.AXIS_RULES`), `zero_stage` adds ZeRO on `data`. The weights'
logical names come from their annotations (NNX `nnx.with_partitioning`, Linen
`nn.with_logical_partitioning`) or, for a model without them, from ordered
path patterns (`meshtrain.models.patterns`).
"""

from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import optax
from flax import nnx
from jax.sharding import Mesh

from meshtrain import rules as r
from meshtrain.analysis import plan
from meshtrain.models.patterns import Patterns, names_by_path
from meshtrain.train.state import ModelSpec, TrainState, init_state, nnx_spec, state_shardings
from meshtrain.train.step import TrainStep


def linen_spec(module: nn.Module, *example_inputs, seed: int = 0,
               patterns: Patterns | None = None) -> ModelSpec:
  """The spec of a Linen module: weights from `module.init(key, *example_inputs)["params"]`,
  names from `nn.with_logical_partitioning` or `patterns`."""
  def boxed():
    return module.init(jax.random.key(seed), *example_inputs)["params"]

  abstract_boxed = jax.eval_shape(boxed)
  abstract = nn.meta.unbox(abstract_boxed)
  if patterns is None:
    specs = nn.get_partition_spec(abstract_boxed)
    names = jax.tree.map(tuple, specs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
  else:
    names = names_by_path(abstract, patterns)
  return ModelSpec(lambda: nn.meta.unbox(boxed()), abstract, names)


class Trainer:
  """A model's sharded state and its compiled train step on one mesh."""

  def __init__(self, spec: ModelSpec, loss_fn: Callable[[Any, dict], jax.Array],
               optimizer: optax.GradientTransformation, mesh: Mesh, *, zero_stage: int = 0,
               grad_accum_steps: int = 1, param_dtype: str = "float32", nan_policy: str = "stop"):
    """`loss_fn(params, batch)`: the mean loss, `params` the pure dict of weights."""
    self.spec, self.mesh, self.optimizer = spec, mesh, optimizer
    self.loss_fn, self.param_dtype = loss_fn, param_dtype
    self.rules = r.strategy_rules(mesh, zero_stage)
    self.shardings = state_shardings(spec, optimizer, mesh, self.rules)
    self.step = TrainStep(loss_fn, spec.names, optimizer, mesh, self.rules, self.shardings,
                          grad_accum_steps=grad_accum_steps, param_dtype=param_dtype,
                          nan_policy=nan_policy)

  @classmethod
  def for_nnx(cls, create: Callable[[], nnx.Module], loss_fn: Callable[[nnx.Module, dict], jax.Array],
              optimizer: optax.GradientTransformation, mesh: Mesh, *,
              patterns: Patterns | None = None, **options) -> "Trainer":
    """`create()` builds the model (with its seed); `loss_fn(model, batch)`."""
    spec = nnx_spec(create, patterns)
    return cls(spec, lambda params, batch: loss_fn(nnx.merge(spec.graphdef, params), batch),
               optimizer, mesh, **options)

  def init(self) -> TrainState:
    """Fresh weights and optimizer state, created in their shards."""
    return init_state(self.spec, self.optimizer, self.shardings)

  def place(self, batch: dict) -> dict:
    """A host batch as global arrays laid out for the step (single process)."""
    return jax.device_put(batch, self.step.batch_sharding)

  def model(self, state: TrainState) -> nnx.Module:
    """The NNX module with the state's weights (sharded as they are), e.g. to evaluate."""
    return nnx.merge(self.spec.graphdef, state.params)

  def plan(self, batch: dict) -> dict:
    """Per-device memory of the step on batches shaped like `batch`, activations
    read from the model (`meshtrain.analysis.plan.trainer_plan`); nothing runs."""
    return plan.trainer_plan(self, batch)

  def param_shardings(self) -> Any:
    """NamedShardings of the weights as forward and backward use them."""
    return r.tree_shardings(self.spec.names, self.mesh, self.rules.params)

  def placement(self) -> list[tuple[str, tuple[int, ...], str]]:
    """(path, shape, PartitionSpec) of every weight: where the rules put it."""
    flat = jax.tree_util.tree_flatten_with_path(self.param_shardings())[0]
    shapes = jax.tree.leaves(self.spec.abstract_params)
    return [(jax.tree_util.keystr(path, simple=True, separator="/"), tuple(x.shape), str(s.spec))
            for (path, s), x in zip(flat, shapes)]

