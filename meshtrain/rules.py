"""Logical axis names, the rules tables that map them to mesh axes, and their use.

Model code names logical axes only. A parallelism strategy is a rules table:
logical name -> mesh axes. Composing strategies concatenates their tables per
name, in mesh-axis order. A logical name with no rule is replicated, except a
mesh axis's own name (`P('tensor', 'fsdp')` annotations), which means that axis.

Parameters and activations use different names where their placement differs:
under `fsdp` a weight's `embed` dimension is sharded, an activation's
`act_embed` never is.
"""

from collections.abc import Iterable, Mapping, Sequence
import dataclasses
import functools
import math

import flax.core.spmd
import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from meshtrain.errors import ConfigError
from meshtrain.mesh import AXES

Rules = tuple[tuple[str, tuple[str, ...]], ...]

# Logical names of weights. `experts` is the leading dimension of the routed
# experts' weights and `expert_mlp` their hidden width: names of their own, so
# that expert parallelism (config.expert_parallel) and expert tensor
# parallelism never meet `embed`'s or `mlp`'s axes in one spec.
VOCAB, EMBED, HEADS, KV_HEADS, HEAD_DIM, MLP, LAYERS, NORM, EXPERTS, EXPERT_MLP, LATENT = (
    "vocab", "embed", "heads", "kv_heads", "head_dim", "mlp", "layers", "norm", "experts",
    "expert_mlp", "latent")
# Logical names of activations. `res_length` is the length in the residual
# stream and norms, which Megatron sequence parallelism splits over `tensor`.
BATCH, LENGTH, RES_LENGTH, ACT_EMBED, ACT_HEADS, ACT_KV_HEADS, ACT_MLP, ACT_VOCAB = (
    "batch", "length", "res_length", "act_embed", "act_heads", "act_kv_heads", "act_mlp",
    "act_vocab")
WEIGHT_NAMES = (VOCAB, EMBED, HEADS, KV_HEADS, HEAD_DIM, MLP, LAYERS, NORM, EXPERTS, EXPERT_MLP,
                LATENT)
ACTIVATION_NAMES = (BATCH, LENGTH, RES_LENGTH, ACT_EMBED, ACT_HEADS, ACT_KV_HEADS, ACT_MLP,
                    ACT_VOCAB)
LOGICAL_NAMES = WEIGHT_NAMES + ACTIVATION_NAMES

# What each mesh axis shards, as its own rules table.
AXIS_RULES: Mapping[str, Mapping[str, str]] = {
    "data": {BATCH: "data"},
    "fsdp": {BATCH: "fsdp", EMBED: "fsdp", EXPERTS: "fsdp", LATENT: "fsdp"},
    "tensor": {name: "tensor" for name in
               (HEADS, KV_HEADS, MLP, VOCAB, EXPERT_MLP, ACT_HEADS, ACT_KV_HEADS, ACT_MLP,
                ACT_VOCAB)},
    "sequence": {LENGTH: "sequence", RES_LENGTH: "sequence"},
    "pipeline": {LAYERS: "pipeline"},
}
# Megatron sequence parallelism: norm and residual regions split the length over
# `tensor`; GSPMD then all-gathers into each tensor-parallel block and
# reduce-scatters out of it, where plain TP all-reduces.
TENSOR_SEQUENCE_PARALLEL = {RES_LENGTH: "tensor"}
# Key/value heads that `tensor` does not divide stay whole on every device (each
# device keeps all kv heads and its share of query heads).
WHOLE_KV_HEADS = (KV_HEADS, ACT_KV_HEADS)


def compose(*tables: Mapping[str, str | Sequence[str]] | Rules) -> Rules:
  """Merges rules tables: a name's mesh axes are concatenated, in mesh order."""
  merged: dict[str, list[str]] = {}
  for table in tables:
    for name, axes in dict(table).items():
      axes = (axes,) if isinstance(axes, str) else tuple(axes)
      merged.setdefault(name, []).extend(a for a in axes if a not in merged[name])
  return tuple((name, tuple(sorted(axes, key=AXES.index))) for name, axes in merged.items())


@dataclasses.dataclass(frozen=True)
class ShardingRules:
  """The tables of one strategy: working weights, their gradients, and the
  optimizer state together with the float32 master weights."""
  params: Rules
  grads: Rules
  optimizer: Rules


# ZeRO on the `data` axis: what stage k adds to the tables it names.
ZERO_ON_DATA = {EMBED: "data", LATENT: "data"}
ZERO_STAGES = (0, 1, 2, 3)


def strategy_rules(mesh: Mesh, zero_stage: int = 0, *, tensor_sequence_parallel: bool = False,
                   split_kv_heads: bool = True,
                   expert_axes: Sequence[str] = ("fsdp",)) -> ShardingRules:
  """The rules for every mesh axis larger than one, composed; `zero_stage`
  shards over `data` the optimizer state (1), then the gradients (2), then the
  working weights (3) — each stage one more table gets ZERO_ON_DATA.
  `expert_axes` split the routed experts (expert parallelism; `fsdp` by default)."""
  return _strategy_rules(mesh, zero_stage, tensor_sequence_parallel, split_kv_heads,
                         tuple(expert_axes))


@functools.lru_cache(maxsize=4096)  # a planner's search asks for the same few tables
def _strategy_rules(mesh: Mesh, zero_stage: int, tensor_sequence_parallel: bool,
                    split_kv_heads: bool, expert_axes: tuple[str, ...]) -> ShardingRules:
  tables = [{k: v for k, v in AXIS_RULES[axis].items() if k != EXPERTS}
            for axis in AXES if mesh.shape[axis] > 1]
  tables.append({EXPERTS: tuple(a for a in expert_axes if mesh.shape[a] > 1)})
  if mesh.shape["tensor"] > 1:
    if not split_kv_heads:
      tables = [{k: v for k, v in t.items() if k not in WHOLE_KV_HEADS} for t in tables]
    if tensor_sequence_parallel:
      tables.append(TENSOR_SEQUENCE_PARALLEL)
  table = compose(*tables)
  if mesh.shape["data"] == 1 or zero_stage == 0:
    return ShardingRules(params=table, grads=table, optimizer=table)
  zero = compose(table, ZERO_ON_DATA)
  return ShardingRules(params=zero if zero_stage >= 3 else table,
                       grads=zero if zero_stage >= 2 else table,
                       optimizer=zero)


def with_names(strategy: ShardingRules, extra: Mapping) -> ShardingRules:
  """The strategy's tables with a model's own logical names added.

  `{"kv": "head_dim"}` gives a foreign name the rule of a meshtrain name in each
  table (so ZeRO stages still apply to it), `{"hidden": "tensor"}` or
  `("fsdp", "tensor")` names mesh axes directly, `None` keeps it whole. A name
  given here replaces the strategy's rule of that name.
  """
  targets = {name: (t,) if t is None or isinstance(t, str) else tuple(t)
             for name, t in extra.items()}
  for name, names in targets.items():
    bad = [t for t in names if t is not None and t not in AXES and t not in LOGICAL_NAMES]
    if bad:
      raise ConfigError(f"rules[{name!r}]",
                        f"{bad[0]!r} is neither a mesh axis ({', '.join(AXES)}) nor a "
                        f"meshtrain logical name ({', '.join(LOGICAL_NAMES)})")

  def apply(table: Rules) -> Rules:
    base = dict(table)
    merged = {name: axes for name, axes in base.items() if name not in targets}
    for name, names in targets.items():
      axes = [a for t in names if t is not None
              for a in (base.get(t, ()) if t in LOGICAL_NAMES else (t,))]
      merged[name] = tuple(sorted(dict.fromkeys(axes), key=AXES.index))
    return tuple(merged.items())

  return ShardingRules(apply(strategy.params), apply(strategy.grads), apply(strategy.optimizer))


def without_axis(rules: Rules, axis: str) -> Rules:
  """The same table with one mesh axis taken out (for code that maps over it)."""
  return tuple((name, tuple(a for a in axes if a != axis)) for name, axes in rules)


def _axes_of(name, table: Mapping[str, tuple[str, ...]]) -> tuple[str, ...]:
  """The mesh axes of one dimension's annotation: a logical name, a mesh axis
  name with no rule of its own, or a tuple of either (`P(('data', 'fsdp'))`)."""
  if name is None:
    return ()
  if isinstance(name, tuple):
    return tuple(a for part in name for a in _axes_of(part, table))
  return table.get(name, (name,) if name in AXES else ())


def _mesh_order(axis: str) -> int:
  return AXES.index(axis) if axis in AXES else len(AXES)


def logical_to_spec(names: Iterable, rules: Rules) -> PartitionSpec:
  """PartitionSpec for logical names; a name without a rule is replicated, and a
  mesh axis is used at most once (by the first dimension that asks for it).

  A dimension split over several mesh axes lists them in mesh order, whatever
  order an annotation gave (`P(('tensor', 'fsdp'))` -> `P(('fsdp', 'tensor'))`):
  jax 0.10's partitioners place a dot's output shards on the wrong devices for
  some layouts with the axes the other way round (docs/partitioner_issues.md)."""
  table = dict(rules)
  taken: set[str] = set()
  spec = []
  for name in names:
    axes = tuple(sorted(dict.fromkeys(a for a in _axes_of(name, table) if a not in taken),
                        key=_mesh_order))
    taken.update(axes)
    spec.append(None if not axes else axes[0] if len(axes) == 1 else axes)
  return PartitionSpec(*spec)


def _is_variable(x) -> bool:
  return isinstance(x, nnx.Variable)


def logical_names(state: nnx.State) -> dict:
  """The logical names of every variable of an NNX state, as a pure dict."""
  names = jax.tree.map(lambda v: tuple(v.get_metadata().get("out_sharding") or ()),
                       state, is_leaf=_is_variable)
  return nnx.State(names).to_pure_dict() if isinstance(names, nnx.State) else names


def tree_shardings(names_tree, mesh: Mesh, rules: Rules):
  """NamedShardings for a tree whose leaves are tuples of logical names."""
  return jax.tree.map(lambda names: NamedSharding(mesh, logical_to_spec(names, rules)),
                      names_tree, is_leaf=lambda x: isinstance(x, tuple))


def constrain(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
  """Pins an activation's layout to its logical names under the active rules.

  A no-op outside `nnx.logical_axis_rules` or without a mesh, so the same model
  runs unsharded under plain `jax.jit`.
  """
  rules = flax.core.spmd.get_logical_axis_rules()
  if not rules or jax.sharding.get_abstract_mesh().empty:
    return x
  return jax.lax.with_sharding_constraint(x, logical_to_spec(names, rules))


def gathered(w: jax.Array, compute_names: Sequence[str | None],
             names: Sequence[str | None]) -> jax.Array:
  """`constrain(w, compute_names)`, whose gradient comes back constrained to
  `names`, the weight's own layout, rather than to `compute_names` (jax's
  transpose of a constraint). Inside a `shard_map` (a pipeline's stage) it
  is `constrain`: resharding the gradient there, XLA's partitioner failed a
  check (jax 0.10.2: `ExpandDeviceGroupsWithIota`, pipeline=2 x fsdp=2 x
  tensor=2 under ZeRO-3)."""
  rules = flax.core.spmd.get_logical_axis_rules()
  mesh = jax.sharding.get_abstract_mesh()
  if not rules or mesh.empty or mesh.manual_axes:
    return constrain(w, compute_names)
  return _constrained(w, logical_to_spec(compute_names, rules), logical_to_spec(names, rules))


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _constrained(w: jax.Array, spec: PartitionSpec, grad_spec: PartitionSpec) -> jax.Array:
  return jax.lax.with_sharding_constraint(w, spec)


def _constrained_fwd(w, spec, grad_spec):
  return _constrained(w, spec, grad_spec), None


def _constrained_bwd(spec, grad_spec, _, g):
  return (jax.lax.with_sharding_constraint(g, grad_spec),)


_constrained.defvjp(_constrained_fwd, _constrained_bwd)


def shards(name: str, size: int) -> int:
  """Into how many pieces the active rules split a dimension `name` of `size`
  on the mesh in context, over its axes not already manual: 1 outside rules
  or a mesh, or where they do not divide `size`."""
  rules = flax.core.spmd.get_logical_axis_rules()
  mesh = jax.sharding.get_abstract_mesh()
  if not rules or mesh.empty:
    return 1
  count = math.prod(mesh.shape.get(a, 1) for a in _axes_of(name, dict(rules))
                    if a not in mesh.manual_axes)
  return count if size % count == 0 else 1


def _flat_names(names_tree):
  return jax.tree_util.tree_flatten_with_path(names_tree, is_leaf=lambda x: isinstance(x, tuple))[0]


def _where(path) -> str:
  return jax.tree_util.keystr(path, simple=True, separator="/")


def check_layout(abstract_params, names_tree, mesh: Mesh, rules: ShardingRules) -> None:
  """Every weight's names against its rank, and every dimension against the
  mesh axes each table splits it over. Raises ConfigError naming the weight,
  its shape and its names, where jit would fail later naming neither."""
  tables = (("weights", rules.params), ("gradients", rules.grads),
            ("optimizer state", rules.optimizer))
  for (path, names), leaf in zip(_flat_names(names_tree), jax.tree.leaves(abstract_params)):
    shape = tuple(leaf.shape)
    if names and len(names) != len(shape):
      raise ConfigError(_where(path), f"shape {shape} has {len(shape)} dimensions but its "
                        f"annotation names {len(names)}: {names}; give one name (or None) "
                        "per dimension")
    for label, table in tables:
      for dim, (size, name, axes) in enumerate(zip(shape, names, logical_to_spec(names, table))):
        axes = (axes,) if isinstance(axes, str) else tuple(axes or ())
        count = math.prod(mesh.shape[a] for a in axes)
        if size % count:
          raise ConfigError(
              _where(path), f"dimension {dim} ({name!r}) of shape {shape}, names {names}, does "
              f"not split over {' x '.join(axes)} = {count} devices ({label}); use a mesh "
              f"that divides {size}, or map {name!r} elsewhere with Trainer(rules=...)")


def layout_changes(names_tree, mesh: Mesh, rules: Rules) -> list[str]:
  """What `logical_to_spec` does to the annotations of a tree of logical names
  that they did not ask for, one line per distinct annotation (with the first
  leaf that has it): a dimension's mesh axes put into mesh order, a mesh axis
  left out of a dimension because an earlier dimension already splits over it."""
  table, notes = dict(rules), {}
  for path, names in _flat_names(names_tree):
    taken: set[str] = set()
    for i, name in enumerate(names):
      asked = [a for a in _axes_of(name, table) if mesh.shape.get(a, 1) > 1]
      kept = [a for a in asked if a not in taken]
      for axis in asked:
        if axis in taken:
          notes.setdefault((names, i, axis), f"{_where(path)} {names}: dimension {i} ({name}) "
                           f"is not split over '{axis}', which an earlier dimension uses")
      if kept != sorted(kept, key=_mesh_order):
        notes.setdefault((names, i), f"{_where(path)} {names}: dimension {i} ({name}) splits "
                         f"over {tuple(sorted(kept, key=_mesh_order))} in mesh order, not "
                         f"{tuple(kept)}")
      taken.update(kept)
  return list(notes.values())


def unknown_names(names_tree, rules: Rules) -> dict[str, list[str]]:
  """Names used by the weights that no table, meshtrain or the mesh knows
  (a model's own vocabulary): name -> the weights that use it, all replicated."""
  known = set(dict(rules)) | set(LOGICAL_NAMES) | set(AXES)
  unknown: dict[str, list[str]] = {}
  for path, names in _flat_names(names_tree):
    for name in jax.tree.leaves(names):
      if name not in known:
        unknown.setdefault(name, []).append(_where(path))
  return unknown


def replicated_share(abstract_params, names_tree, mesh: Mesh, rules: Rules,
                     axes: Sequence[str] | None = None) -> dict[str, float]:
  """For each mesh axis larger than one in `axes` (default: all but `data`),
  the share of parameter bytes that are not split over it: a check that the
  rules cover the model (a large share under `fsdp` means weights are held whole)."""
  sizes = jax.tree.leaves(jax.tree.map(lambda a: a.size * a.dtype.itemsize, abstract_params))
  specs = [logical_to_spec(names, rules) for _, names in _flat_names(names_tree)]
  total = sum(sizes)
  report = {}
  for axis in axes if axes is not None else [a for a in AXES if a != "data"]:
    if mesh.shape[axis] == 1:
      continue
    unsplit = sum(size for size, spec in zip(sizes, specs)
                  if axis not in jax.tree.leaves(tuple(spec)))
    report[axis] = unsplit / total
  return report
