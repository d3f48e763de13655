"""meshtrain: every parallelism strategy as partitioning rules on one device mesh.

The public API (stable names):

  make_mesh({"fsdp": 4, "tensor": 2})        the 5-axis mesh (missing axes 1; data or fsdp -1 fills)
  strategy_rules(mesh, zero_stage)           the rules tables of the axes larger than one
  with_names(rules, {"kv": "heads"})         the same tables with a model's own logical names
  logical_to_spec(names, table)              logical names -> PartitionSpec
  tree_shardings(names_tree, mesh, table)    a tree of logical names -> NamedShardings
  replicated_share(params, names, mesh, t)   share of weight bytes each mesh axis leaves whole
  nnx_spec(create, patterns)                 any flax NNX model: weights, shapes, logical names
  linen_spec(module, *inputs, patterns=...)  the same for a Linen module
  FLAX_TRANSFORMER, names_by_path            path patterns for models without annotations
  Trainer(spec, loss_fn, optimizer, mesh)    sharded init and the compiled train step
  Trainer.for_nnx(create, loss_fn, ...)      the same from an NNX model and loss(model, batch)
  Trainer.from_config(cfg)                  meshtrain's Llama of a config, every strategy (as `train`)
  trainer.verify(batch, steps=2)             the sharded step against unsharded plain jax.jit

Logical names (VOCAB, EMBED, ... in WEIGHT_NAMES and ACTIVATION_NAMES) and the
rules tables (AXIS_RULES per mesh axis, TENSOR_SEQUENCE_PARALLEL, ZERO_ON_DATA)
are exported as constants.
"""

from meshtrain import quiet_cuda

quiet_cuda.start()  # before the imports below load jax

from meshtrain.analysis.selfcheck import Report as VerifyReport
from meshtrain.mesh import AXES, make_mesh
from meshtrain.models.patterns import (
    CATCH_ALL,
    FLAX_LAYERS,
    FLAX_TRANSFORMER,
    GEMMA_NAMES,
    HF_FLAX_NAMES,
    LINEN_AUTO_NAMES,
    names_by_path,
)
from meshtrain.rules import (
    ACT_EMBED,
    ACT_HEADS,
    ACT_KV_HEADS,
    ACT_MLP,
    ACT_VOCAB,
    ACTIVATION_NAMES,
    AXIS_RULES,
    BATCH,
    EMBED,
    EXPERT_MLP,
    EXPERTS,
    HEAD_DIM,
    HEADS,
    KV_HEADS,
    LATENT,
    LAYERS,
    LENGTH,
    LOGICAL_NAMES,
    MLP,
    NORM,
    RES_LENGTH,
    TENSOR_SEQUENCE_PARALLEL,
    VOCAB,
    WEIGHT_NAMES,
    ZERO_ON_DATA,
    ShardingRules,
    compose,
    logical_to_spec,
    replicated_share,
    strategy_rules,
    tree_shardings,
    with_names,
)
from meshtrain.train.state import ModelSpec, TrainState, nnx_spec
from meshtrain.trainer import Placement, Trainer, linen_spec

__all__ = [
    "ACTIVATION_NAMES", "ACT_EMBED", "ACT_HEADS", "ACT_KV_HEADS", "ACT_MLP", "ACT_VOCAB", "AXES",
    "AXIS_RULES", "BATCH", "CATCH_ALL", "EMBED", "EXPERTS", "EXPERT_MLP",
    "FLAX_LAYERS", "FLAX_TRANSFORMER", "GEMMA_NAMES",
    "HEADS", "HEAD_DIM", "HF_FLAX_NAMES", "KV_HEADS", "LATENT", "LAYERS", "LENGTH",
    "LINEN_AUTO_NAMES",
    "LOGICAL_NAMES", "MLP", "ModelSpec", "NORM", "Placement", "RES_LENGTH", "ShardingRules",
    "TENSOR_SEQUENCE_PARALLEL", "TrainState", "Trainer", "VOCAB", "VerifyReport", "WEIGHT_NAMES",
    "ZERO_ON_DATA", "compose", "linen_spec", "logical_to_spec", "make_mesh", "names_by_path",
    "nnx_spec", "replicated_share", "strategy_rules", "tree_shardings", "with_names",
]
