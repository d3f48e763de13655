"""meshtrain's rules and train step for any model, and for meshtrain's own.

    trainer = Trainer.for_nnx(lambda: MyModel(rngs=nnx.Rngs(0)), loss_fn, optax.adamw(1e-3),
                              make_mesh({"fsdp": 4, "tensor": 2}), patterns=FLAX_TRANSFORMER)
    state = trainer.init()                       # weights and optimizer state, in shards
    state, metrics = trainer.step(state, batch)  # {"inputs": [B, L], ...}: rows over data x fsdp

The strategy is the mesh: every axis larger than one applies its rules table
(`meshtrain.rules.AXIS_RULES`), `zero_stage` adds ZeRO on `data`. The weights'
logical names come from their annotations (NNX `nnx.with_partitioning`, Linen
`nn.with_logical_partitioning`, or mesh axis names such as `P('tensor', 'fsdp')`,
honoured as those axes) or, for a model without them, from ordered path
patterns (`meshtrain.models.patterns`). A model's own names join the tables
through `rules={"kv": "head_dim"}`.

meshtrain's Llama of a config, with every strategy the config names (the
pipeline, local SGD, offload, float16 loss scaling, experts), is the object
`meshtrain train` trains:

    trainer = Trainer.from_config(meshtrain.config.load("configs/pp_1f1b.py", "tiny"))
"""

import dataclasses
import functools
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import flax.linen as nn
import jax
import optax
from flax import nnx
from jax.sharding import Mesh

from meshtrain import rules as r
from meshtrain.analysis import selfcheck
from meshtrain.errors import ConfigError
from meshtrain.models.patterns import Patterns, names_by_path
from meshtrain.planner import plan
from meshtrain.train.setup import Setup, build
from meshtrain.train.state import ModelSpec, TrainState, merged, nnx_spec, state_shardings
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


def _without_counts(loss_fn: Callable[[Any, dict], jax.Array], params, batch: dict,
                    model_state):
  """A model's `loss_fn(params, batch)` as meshtrain's step calls a loss."""
  return loss_fn(params, batch), {}


# Mesh axes that split weights; `data` too where ZeRO shards the optimizer state.
WEIGHT_AXES = ("fsdp", "tensor", "pipeline")


@dataclasses.dataclass(frozen=True)
class Placement:
  """Where one weight lives: its working copy in forward and backward, its
  gradient, and its float32 master copy with the optimizer's moments."""
  path: str
  shape: tuple[int, ...]
  params: str
  grads: str
  optimizer: str


def _kv_heads_split(spec: ModelSpec, tensor: int) -> bool:
  """Whether `tensor` divides every dimension named kv_heads; where it does not,
  each device keeps all key/value heads, as meshtrain's own model does."""
  names = jax.tree.leaves(spec.names, is_leaf=lambda n: isinstance(n, tuple))
  sizes = [size for dims, x in zip(names, jax.tree.leaves(spec.abstract_params))
           for name, size in zip(dims, x.shape) if name == r.KV_HEADS]
  return all(size % tensor == 0 for size in sizes)


class Trainer:
  """A model's sharded state and its compiled train step on one mesh: a
  `meshtrain.train.setup.Setup` (`setup`), the object `meshtrain train`
  trains, with what a user asks of it. Any model through the constructor
  (`for_nnx`, `linen_spec`); meshtrain's Llama of a config, with every
  strategy the config names, through `from_config`."""

  def __init__(self, spec: ModelSpec, loss_fn: Callable[[Any, dict], jax.Array],
               optimizer: optax.GradientTransformation, mesh: Mesh, *,
               rules: Mapping[str, str | Sequence[str] | None] | None = None, zero_stage: int = 0,
               grad_accum_steps: int = 1, param_dtype: str = "float32", nan_policy: str = "stop",
               strict: bool = False, max_replicated_share: float = 0.1):
    """`loss_fn(params, batch)`: the mean loss, `params` the pure dict of weights.

    `rules`: the model's own logical names, each mapped to a meshtrain name
    (`{"kv": "heads"}`) or to mesh axes (`{"hidden": "tensor"}`). When the
    weights that an axis larger than one leaves whole exceed
    `max_replicated_share` of the bytes, or a name has no rule, the trainer
    warns (`strict=True`: raises ConfigError).
    """
    strategy = r.strategy_rules(mesh, zero_stage,
                                split_kv_heads=_kv_heads_split(spec, mesh.shape["tensor"]))
    table = r.with_names(strategy, rules or {})
    r.check_layout(spec.abstract_params, spec.names, mesh, table)
    shardings = state_shardings(spec, optimizer, mesh, table)
    step_loss = functools.partial(_without_counts, loss_fn)
    step = TrainStep(step_loss, spec.names, optimizer, mesh, table, shardings,
                     grad_accum_steps=grad_accum_steps, param_dtype=param_dtype,
                     nan_policy=nan_policy)
    self._adopt(Setup(spec, optimizer, shardings, step, step_loss), loss_fn, param_dtype,
                zero_stage)
    self._report_coverage(max_replicated_share, strict)

  @classmethod
  def from_config(cls, cfg, devices=None) -> "Trainer":
    """meshtrain's Llama of `cfg` on `devices` (default: this machine's),
    built as `meshtrain train` builds it (`meshtrain.train.setup.build`), with
    every strategy and feature the config names: the pipeline, local SGD,
    offload, float16 loss scaling, experts. Its `loss_fn(params, batch)` is
    the step's loss with the model state as it starts."""
    setup = build(cfg, devices)
    trainer = cls.__new__(cls)

    def loss_fn(params, batch):
      return setup.loss_fn(params, batch, setup.spec.init_model_state())[0]
    trainer._adopt(setup, loss_fn, setup.cfg.param_dtype, setup.cfg.zero_stage)
    return trainer

  def _adopt(self, setup: Setup, loss_fn: Callable[[Any, dict], jax.Array], param_dtype: str,
             zero_stage: int) -> None:
    self.setup, self.loss_fn, self.param_dtype = setup, loss_fn, param_dtype
    self.spec, self.mesh, self.optimizer = setup.spec, setup.mesh, setup.optimizer
    self.rules, self.shardings, self.step = setup.rules, setup.shardings, setup.train_step
    axes = ("data",) * (zero_stage > 0) + WEIGHT_AXES
    self.replicated = r.replicated_share(self.spec.abstract_params, self.spec.names, self.mesh,
                                         self.rules.optimizer, axes)

  def _report_coverage(self, max_share: float, strict: bool) -> None:
    problems = [f"{share:.0%} of weight bytes are whole on every '{axis}' shard"
                for axis, share in self.replicated.items() if share > max_share]
    unknown = r.unknown_names(self.spec.names, self.rules.params)
    problems += [f"logical name {name!r} has no rule (on {', '.join(paths[:3])}"
                 f"{', ...' if len(paths) > 3 else ''}), so it is replicated"
                 for name, paths in unknown.items()]
    if not problems:
      return
    message = ("; ".join(problems) + ". Name the dimensions with meshtrain's logical names "
               f"({', '.join(r.WEIGHT_NAMES)}) or map the model's own with "
               "Trainer(rules={'its_name': 'heads'}); trainer.placement() shows each weight")
    if strict:
      raise ConfigError("rules", message)
    warnings.warn(message, stacklevel=3)

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
    return self.setup.init_state()

  def place(self, batch: dict) -> dict:
    """A host batch as global arrays laid out for the step (single process)."""
    return jax.device_put(batch, self.step.batch_sharding)

  def model(self, state: TrainState) -> nnx.Module:
    """The NNX module with the state's weights and model state (sharded as
    they are), e.g. to evaluate."""
    return merged(self.spec, state.params, state.model_state)

  def plan(self, batch: dict) -> dict:
    """Per-device memory of the step on batches shaped like `batch`, activations
    read from the model (`meshtrain.planner.plan.trainer_plan`); nothing runs."""
    return plan.trainer_plan(self, batch)

  def param_shardings(self) -> Any:
    """NamedShardings of the weights as forward and backward use them."""
    return r.tree_shardings(self.spec.names, self.mesh, self.rules.params)

  def placement(self) -> list[Placement]:
    """Every weight's PartitionSpec as working weight, gradient and optimizer
    state (under ZeRO-1 only the last is split over `data`)."""
    specs = [jax.tree.leaves(r.tree_shardings(self.spec.names, self.mesh, table))
             for table in (self.rules.params, self.rules.grads, self.rules.optimizer)]
    flat = jax.tree_util.tree_flatten_with_path(self.spec.abstract_params)[0]
    return [Placement(jax.tree_util.keystr(path, simple=True, separator="/"), tuple(x.shape),
                      *(str(s[i].spec) for s in specs))
            for i, (path, x) in enumerate(flat)]

  def placement_table(self) -> str:
    """placement() as aligned text, one weight a line."""
    rows = [("weight", "shape", "weights", "gradients", "optimizer state")]
    rows += [(p.path, str(p.shape), p.params, p.grads, p.optimizer) for p in self.placement()]
    widths = [max(len(row[i]) for row in rows) for i in range(5)]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip()
                     for row in rows)

  def verify(self, batch: dict, steps: int = 2) -> "selfcheck.Report":
    """The sharded step against the same step unsharded under plain `jax.jit`
    (see `meshtrain.analysis.selfcheck`): run it first on a new model or jax."""
    return selfcheck.verify(self.spec, self.optimizer, self.step, self.shardings, batch, steps)
