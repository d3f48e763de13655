"""meshtrain: every parallelism strategy as partitioning rules on one device mesh.

The public API (stable names):

  make_mesh({"fsdp": 4, "tensor": 2})        the 5-axis mesh (missing axes are 1, one may be -1)
  strategy_rules(mesh, zero_stage)           the rules tables of the axes larger than one
  logical_to_spec(names, table)              logical names -> PartitionSpec
  tree_shardings(names_tree, mesh, table)    a tree of logical names -> NamedShardings
  nnx_spec(create, patterns)                 any flax NNX model: weights, shapes, logical names
  linen_spec(module, *inputs, patterns=...)  the same for a Linen module
  FLAX_TRANSFORMER, names_by_path            path patterns for models without annotations
  Trainer(spec, loss_fn, optimizer, mesh)    sharded init and the compiled train step
  Trainer.for_nnx(create, loss_fn, ...)      the same from an NNX model and loss(model, batch)
"""

from meshtrain.mesh import AXES, make_mesh
from meshtrain.models.patterns import FLAX_TRANSFORMER, names_by_path
from meshtrain.rules import (
    AXIS_RULES,
    ShardingRules,
    compose,
    logical_to_spec,
    strategy_rules,
    tree_shardings,
)
from meshtrain.train.state import ModelSpec, TrainState, nnx_spec
from meshtrain.trainer import Trainer, linen_spec

__all__ = [
    "AXES", "AXIS_RULES", "FLAX_TRANSFORMER", "ModelSpec", "ShardingRules", "TrainState",
    "Trainer", "compose", "linen_spec", "logical_to_spec", "make_mesh", "names_by_path",
    "nnx_spec", "strategy_rules", "tree_shardings",
]
