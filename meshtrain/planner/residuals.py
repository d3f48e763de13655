"""What a model saves for its backward, read from the model itself, per device.

`saved_residuals` traces `jax.vjp` of a loss on abstract values (no FLOPs, no
arrays): the outputs of the traced forward are exactly the residuals jax keeps
for the backward under whatever `jax.checkpoint` policies the model uses. Each
residual's layout then follows from the rules by a small sharding propagation
over the same jaxpr: inputs start in their rules layouts (the batch over its
axes, weights in their compute layout), `sharding_constraint` and `shard_map`
pin layouts where the model says so, and every other op carries its operands'
dimension splits through (elementwise ops, dot_general, transposes, reshapes,
broadcasts, reductions, scans and nested calls). An op it does not know
leaves its outputs whole on every device: an over-estimate, never an under one.

This works for any model `Trainer` can train, not only meshtrain's Llama.
"""

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from meshtrain import jax_internals as core
from meshtrain import rules as r
from meshtrain.jax_internals import param

BATCH_AXES = ("data", "fsdp")
Spec = tuple[tuple[str, ...], ...]  # mesh axes splitting each dimension


@dataclasses.dataclass(frozen=True)
class Residual:
  shape: tuple[int, ...]
  dtype: str
  spec: Spec
  device_bytes: int  # on one device
  on_host: bool = False  # kept in host memory (an offloading `jax.checkpoint` policy)

  @property
  def bytes(self) -> int:
    return math.prod(self.shape) * np.dtype(self.dtype).itemsize


def _device_bytes(shape, dtype, spec: Spec, mesh) -> int:
  shards = [math.prod(mesh.shape[a] for a in axes) for axes in spec]
  return math.prod(-(-n // k) for n, k in zip(shape, shards)) * np.dtype(dtype).itemsize


def _from_partition_spec(spec, rank: int) -> Spec:
  parts = list(spec) + [None] * (rank - len(spec))
  return tuple((p,) if isinstance(p, str) else tuple(p) if isinstance(p, tuple) else ()
               for p in parts)  # None and P.UNCONSTRAINED: no split known


def _clean(shape, spec: Spec, mesh) -> Spec:
  """Each mesh axis once (first dimension wins), and only where it divides the size."""
  taken, out = set(), []
  for n, axes in zip(shape, spec):
    kept = []
    for a in axes:
      if a not in taken and mesh.shape[a] > 1 and n % (math.prod(mesh.shape[b] for b in kept)
                                                       * mesh.shape[a]) == 0:
        kept.append(a)
        taken.add(a)
    out.append(tuple(kept))
  return tuple(out)


def _whole(rank: int) -> Spec:
  return ((),) * rank


def _elementwise(eqn, specs, shapes) -> list[Spec]:
  """Each output dimension takes the splits of the operands' matching dimension."""
  outs = []
  for out in eqn.outvars:
    shape = out.aval.shape
    spec = [[] for _ in shape]
    for s, operand_shape in zip(specs, shapes):
      if len(operand_shape) != len(shape):
        continue
      for i, (n, axes) in enumerate(zip(operand_shape, s)):
        if n == shape[i] and n > 1:
          spec[i] += [a for a in axes if a not in spec[i]]
    outs.append(tuple(map(tuple, spec)))
  return outs


def _dot_general(eqn, specs, shapes) -> list[Spec]:
  (lc, rc), (lb, rb) = param(eqn, "dimension_numbers")
  (ls, rs), (lshape, rshape) = specs, shapes
  batch = [tuple(dict.fromkeys(ls[i] + rs[j])) for i, j in zip(lb, rb)]
  lfree = [ls[i] for i in range(len(lshape)) if i not in lc and i not in lb]
  rfree = [rs[i] for i in range(len(rshape)) if i not in rc and i not in rb]
  return [tuple(batch + lfree + rfree)]


def _reshape(in_shape, out_shape, spec: Spec) -> Spec:
  """Splits of merged or split dimensions go to the major (first) dimension of the group."""
  out = [()] * len(out_shape)
  i = j = 0
  while i < len(in_shape) and j < len(out_shape):
    gi, gj, pi, pj = [i], [j], in_shape[i], out_shape[j]
    while pi != pj:
      if pi < pj:
        i += 1
        gi.append(i)
        pi *= in_shape[i]
      else:
        j += 1
        gj.append(j)
        pj *= out_shape[j]
    major = next((k for k in gi if in_shape[k] > 1), gi[0])
    target = next((k for k in gj if out_shape[k] > 1), gj[0])
    out[target] = spec[major]
    i, j = i + 1, j + 1
  return tuple(out)


def _sub_jaxpr(eqn):
  if eqn.primitive.name == "cond":
    return param(eqn, "branches")[0].jaxpr
  sub = core.call_body(eqn)
  return sub.jaxpr if isinstance(sub, core.ClosedJaxpr) else sub


def _rule(eqn, specs, shapes) -> list[Spec]:
  name = eqn.primitive.name
  out_shapes = [v.aval.shape for v in eqn.outvars]
  if name == "sharding_constraint":
    pinned = _from_partition_spec(param(eqn, "sharding").spec, len(out_shapes[0]))
    free = param(eqn, "unconstrained_dims", ()) or ()
    return [tuple(specs[0][i] if i in free else pinned[i] for i in range(len(pinned)))]
  if name == "dot_general":
    return _dot_general(eqn, specs, shapes)
  if name == "transpose":
    return [tuple(specs[0][i] for i in param(eqn, "permutation"))]
  if name == "broadcast_in_dim":
    out = [()] * len(out_shapes[0])
    for i, d in enumerate(param(eqn, "broadcast_dimensions")):
      if shapes[0][i] == out_shapes[0][d]:
        out[d] = specs[0][i]
    return [tuple(out)]
  if name == "reshape":
    return [_reshape(shapes[0], out_shapes[0], specs[0])]
  if name == "squeeze":
    return [tuple(s for i, s in enumerate(specs[0]) if i not in param(eqn, "dimensions"))]
  if name.startswith(("reduce", "arg")) and param(eqn, "axes", None) is not None:
    return [tuple(s for i, s in enumerate(specs[0]) if i not in param(eqn, "axes"))]
  if name == "stack":  # operands of one shape, a new axis
    spec = [tuple(dict.fromkeys(a for s in specs for a in s[i])) for i in range(len(shapes[0]))]
    axis = param(eqn, "axis")
    return [tuple(spec[:axis] + [()] + spec[axis:])]
  if name in ("concatenate", "split"):
    axis = param(eqn, "dimension" if name == "concatenate" else "axis")
    return [tuple(() if i == axis else s for i, s in enumerate(specs[0])) for _ in out_shapes]
  if name in ("iota", "rng_bit_generator", "random_bits"):
    return [_whole(len(s)) for s in out_shapes]
  return _elementwise(eqn, specs, shapes)


def propagate(jaxpr, in_specs: Sequence[Spec], mesh) -> list[Spec]:
  """The layout of each output of `jaxpr`, given its inputs' layouts.

  One forward pass, then one backward pass for partial sums: a matmul that
  contracts a split dimension leaves partial sums, which XLA reduces straight
  into the layout their first user needs (Megatron's row-parallel output
  reduce-scattered under sequence parallelism), so such a value and its
  elementwise copies take the split of the value they feed. A call (a
  `jax.checkpoint` around the matmul) passes its partial sums out."""
  return _propagate(jaxpr, in_specs, mesh)[0]


def _propagate(jaxpr, in_specs: Sequence[Spec], mesh) -> tuple[list[Spec], list[bool]]:
  """`propagate`, and which outputs are partial sums."""
  env, partial = {}, set()

  def read(v) -> Spec:
    if isinstance(v, core.Literal):
      return _whole(np.ndim(v.val))
    return env.get(v, _whole(len(v.aval.shape)))

  for v, s in zip(jaxpr.invars, in_specs):
    env[v] = _clean(v.aval.shape, s, mesh)
  for eqn in jaxpr.eqns:
    specs = [read(v) for v in eqn.invars]
    shapes = [tuple(getattr(v.aval, "shape", ())) for v in eqn.invars]
    nested = _nested(eqn, specs, mesh)
    outs, sums = nested if nested else (_rule(eqn, specs, shapes), [False] * len(eqn.outvars))
    for v, s in zip(eqn.outvars, outs):
      if hasattr(v.aval, "shape"):
        env[v] = _clean(v.aval.shape, s, mesh)
    partial.update(v for v, is_sum in zip(eqn.outvars, sums) if is_sum)
    if _sums_partials(eqn, specs) or (eqn.primitive.name in _COPIES and _is_var(eqn.invars[0])
                                      and eqn.invars[0] in partial):
      partial.add(eqn.outvars[0])
  for eqn in reversed(jaxpr.eqns):
    if not eqn.outvars or not hasattr(eqn.outvars[0].aval, "shape"):
      continue
    out = eqn.outvars[0]
    for v in eqn.invars:
      if _is_var(v) and v in partial and v.aval.shape == out.aval.shape:
        merged = tuple(tuple(dict.fromkeys(a + b)) for a, b in zip(env[v], read(out)))
        env[v] = _clean(v.aval.shape, merged, mesh)
  return [read(v) for v in jaxpr.outvars], [_is_var(v) and v in partial for v in jaxpr.outvars]


def _is_var(v) -> bool:
  return not isinstance(v, core.Literal)


# Ops that copy a value elementwise (a partial sum stays one through them;
# `name` is `checkpoint_name`, which names what selective recomputation saves).
_COPIES = ("reduce_precision", "convert_element_type", "copy", "copy_p", "name")


def _sums_partials(eqn, specs) -> bool:
  if eqn.primitive.name != "dot_general":
    return False
  (lc, rc), _ = param(eqn, "dimension_numbers")
  return any(specs[0][i] for i in lc) or any(specs[1][i] for i in rc)


def _nested(eqn, specs, mesh) -> tuple[list[Spec], list[bool]] | None:
  """Layouts through scans (the stacked axis whole) and calls, and which
  outputs of a call are partial sums; None if not nested."""
  none = [False] * len(eqn.outvars)
  if eqn.primitive.name == "scan":
    body, carry = param(eqn, "jaxpr").jaxpr, param(eqn, "num_carry")
    fixed = param(eqn, "num_consts") + carry
    outs = propagate(body, list(specs[:fixed]) + [s[1:] for s in specs[fixed:]], mesh)
    return outs[:carry] + [((),) + s for s in outs[carry:]], none
  if eqn.primitive.name == "shard_map":  # manual axes from out_specs, automatic ones from the body
    manual = param(eqn, "newly_manual_axes")
    outs = propagate(param(eqn, "jaxpr"), [tuple(tuple(a for a in axes if a not in manual)
                                                 for axes in s) for s in specs], mesh)
    return [tuple(m + tuple(a for a in axes if a not in m) for m, axes in
                  zip(_from_partition_spec(out_spec, len(s)), s))
            for out_spec, s in zip(param(eqn, "out_specs"), outs)], none
  if eqn.primitive.name == "while":
    return list(specs[param(eqn, "cond_nconsts") + param(eqn, "body_nconsts"):]), none
  sub = _sub_jaxpr(eqn)
  if sub is None or len(sub.outvars) != len(eqn.outvars):
    return None
  offset = len(specs) - len(sub.invars)  # cond: the branch index comes first
  if offset < 0:
    return None
  outs, sums = _propagate(sub, specs[offset:], mesh)
  return outs, sums if offset == 0 else none


def _specs(names_tree, rules: r.Rules, drop: Sequence[str] = ()) -> list[Spec]:
  leaves = jax.tree.leaves(names_tree, is_leaf=lambda x: isinstance(x, tuple))
  return [tuple(tuple(a for a in axes if a not in drop)
                for axes in _from_partition_spec(r.logical_to_spec(names, rules), len(names)))
          for names in leaves]


def _forward(loss_fn: Callable[[Any, dict], jax.Array]) -> Callable:
  """`(params, batch) -> the vjp function`, whose leaves are the residuals."""
  return lambda params, batch: jax.vjp(lambda p: loss_fn(p, batch), params)[1]


# Ops whose results XLA recomputes inside their users rather than keep, when
# their operands are integers of the batch, iotas or constants.
_RECOMPUTED_OPS = frozenset((
    "eq", "ne", "lt", "le", "gt", "ge", "and", "or", "not", "xor", "convert_element_type",
    "broadcast_in_dim", "reshape", "squeeze", "expand_dims", "transpose", "select_n", "iota",
    "add", "sub", "mul"))


def _input_dependent(jaxpr, num_params: int) -> set:
  """Values computed from the inputs that the train step keeps. The others
  are constants XLA folds into their users (causal masks from iota, rotary
  tables), or elementwise functions of the batch's integers that it
  recomputes inside their users (the loss's one-hot of the targets: a
  [tokens, vocabulary] float32 array were it kept; seen absent from the
  program XLA's GPU compiler builds, docs/gpu_program.md)."""
  dependent = set(jaxpr.invars)
  integers = {v for v in jaxpr.invars[num_params:] if jnp.issubdtype(v.aval.dtype, jnp.integer)}
  recomputed = set()
  for eqn in jaxpr.eqns:
    if not any(_is_var(v) and v in dependent for v in eqn.invars):
      continue
    dependent.update(eqn.outvars)
    if _recomputed_op(eqn) and all(
        not _is_var(v) or v not in dependent or v in integers or v in recomputed
        for v in eqn.invars):
      recomputed.update(eqn.outvars)
  return dependent - recomputed


def _recomputed_op(eqn) -> bool:
  """An op of `_RECOMPUTED_OPS`, or a call (`jax.nn.one_hot` is jitted) of nothing else."""
  if eqn.primitive.name in ("jit", "pjit"):
    return all(_recomputed_op(inner) for inner in _sub_jaxpr(eqn).eqns)
  return eqn.primitive.name in _RECOMPUTED_OPS


def _new_outputs(jaxpr, num_params: int) -> list[int]:
  """Indices of the residuals that cost memory: computed from the inputs, not
  a weight, not a repeat."""
  params_in, seen, kept = set(jaxpr.invars[:num_params]), set(), []
  dependent = _input_dependent(jaxpr, num_params)
  for i, v in enumerate(jaxpr.outvars):
    if _is_var(v) and v in dependent and v not in params_in and v not in seen:
      seen.add(v)
      kept.append(i)
  return kept


def saved_residuals(loss_fn: Callable[[Any, dict], jax.Array], abstract_params, param_names,
                    abstract_batch: dict, mesh, rules: r.ShardingRules) -> list[Residual]:
  """The arrays `jax.grad(loss_fn)` keeps from its forward for its backward,
  with their layout on `mesh` (an AbstractMesh will do): weights enter in their
  `rules.params` layout, the batch split as `[batch, length]`. Residuals that
  are the weights themselves cost nothing extra, and constants are folded
  into their users: both are left out."""
  mesh = getattr(mesh, "abstract_mesh", mesh)  # a concrete Mesh's shape is all it needs
  with jax.sharding.use_abstract_mesh(mesh), nnx.logical_axis_rules(rules.params):
    jaxpr = jax.make_jaxpr(_forward(loss_fn))(abstract_params, abstract_batch).jaxpr
  batch_names = jax.tree.map(lambda x: (r.BATCH, r.LENGTH)[:len(x.shape)], abstract_batch)
  in_specs = _specs(param_names, rules.params) + _specs(batch_names, rules.params)
  specs = propagate(jaxpr, in_specs, mesh)
  saved = []
  for i in _new_outputs(jaxpr, len(jax.tree.leaves(abstract_params))):
    aval = jaxpr.outvars[i].aval
    shape, dtype = tuple(aval.shape), str(aval.dtype)
    saved.append(Residual(shape, dtype, specs[i], _device_bytes(shape, dtype, specs[i], mesh),
                          aval.memory_space == jax.memory.Space.Host))
  return saved


def output_layouts(fn: Callable, abstract_args: Sequence[Any], arg_names: Sequence[Any], mesh,
                   rules: r.ShardingRules) -> list[Residual]:
  """Each output leaf of `fn(*abstract_args)` with its layout and its bytes a
  device, traced under `rules` on `mesh` (an AbstractMesh will do), each input
  leaf laid out by its logical names (`arg_names`: a tuple per leaf, None for
  a dimension no rule splits), the rest by the same propagation as
  `saved_residuals`."""
  mesh = getattr(mesh, "abstract_mesh", mesh)
  with jax.sharding.use_abstract_mesh(mesh), nnx.logical_axis_rules(rules.params):
    jaxpr = jax.make_jaxpr(fn)(*abstract_args).jaxpr
  specs = propagate(jaxpr, _specs(list(arg_names), rules.params), mesh)
  outs = []
  for v, spec in zip(jaxpr.outvars, specs):
    shape, dtype = tuple(v.aval.shape), str(v.aval.dtype)
    outs.append(Residual(shape, dtype, spec, _device_bytes(shape, dtype, spec, mesh),
                         v.aval.memory_space == jax.memory.Space.Host))
  return outs


def residual_outputs(loss_fn: Callable[[Any, dict], jax.Array]) -> Callable:
  """`fn(params, batch)` returning the residuals `saved_residuals` counts, to
  compile under the mesh and the rules and measure
  (`memory_analysis().output_size_in_bytes`)."""
  forward = _forward(loss_fn)

  def outputs(params, batch):
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), (params, batch))
    kept = _new_outputs(jax.make_jaxpr(forward)(*shapes).jaxpr, len(jax.tree.leaves(params)))
    leaves = jax.tree.leaves(forward(params, batch))
    return [leaves[i] for i in kept]
  return outputs
