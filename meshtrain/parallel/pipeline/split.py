"""A function's backward split into B (input gradient) and W (weight gradient).

Zero-bubble pipelines (Qi et al. 2023) run the two halves of a backward at
different times: B carries the gradient to the previous stage at once, W adds
up the weight gradients whenever the stage is idle. `split_vjp` builds three
functions from one `f(params, x, aux) -> (y, stats)` by cutting jaxprs
(`stats`: values f reports beside y, not differentiated, e.g. MoE counts):

  forward(params, x, aux) -> (y, stash, stats) stash: residuals that depend on x
  backward_input(params, aux, stash, dy) -> (dx, cut)
  backward_weight(params, aux, stash, cut) -> dparams

The residuals are `jax.vjp`'s own (its backward is a pytree whose leaves are
the residual arrays), so a `jax.checkpoint` policy on `f` decides what the
stash holds. Residuals computed from `params` and `aux` alone (cast or
concatenated weights, rotary tables) are not stashed: both halves recompute
them. `cut` holds the values W needs that B computes anyway (the gradients at
the weights' matmul outputs), so together B and W do the work of one
backward: no operation of the backward runs in both. A weight whose gradient
is no matmul (a norm's scale) gets it from B, through the cut: W's job is
the weight matmuls, and the activations such a gradient sums would make the
cut large (two float32 [tokens, embed] arrays a norm).
"""

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax

from meshtrain import jax_internals as core


@dataclasses.dataclass(frozen=True)
class SplitVjp:
  forward: Callable[[Any, jax.Array, Any], tuple[jax.Array, list[jax.Array], Any]]
  backward_input: Callable[[Any, Any, list[jax.Array], jax.Array],
                           tuple[jax.Array, list[jax.Array]]]
  backward_weight: Callable[[Any, Any, list[jax.Array], list[jax.Array]], Any]
  stash: list[jax.ShapeDtypeStruct]  # shapes of one call's stash
  cut: list[jax.ShapeDtypeStruct]    # and of its cut
  stats: Any                         # shapes of what forward reports beside y


def _inline(closed: core.ClosedJaxpr) -> core.ClosedJaxpr:
  """The same computation with the call-like primitives' bodies inlined, so
  that the cut can go through them (a jitted einsum's transpose computes dx
  and dw in one call)."""
  def run(jaxpr: core.Jaxpr, consts: Sequence[Any], *args: Any) -> list[Any]:
    env: dict[core.Var, Any] = {}
    read = lambda v: v.val if isinstance(v, core.Literal) else env[v]
    env.update(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))
    for eqn in jaxpr.eqns:
      values = [read(v) for v in eqn.invars]
      inner = core.call_body(eqn)
      if eqn.primitive.name == "optimization_barrier":  # remat's; B and W are apart anyway
        outs = values
      elif isinstance(inner, core.ClosedJaxpr):
        outs = run(inner.jaxpr, inner.consts, *values)
      elif inner is not None:
        outs = run(inner, (), *values)
      else:
        outs = core.replay(eqn, values)
      env.update(zip(eqn.outvars, outs))
    return [read(v) for v in jaxpr.outvars]

  avals = [v.aval for v in closed.jaxpr.invars]
  return jax.make_jaxpr(lambda *a: run(closed.jaxpr, closed.consts, *a))(
      *avals)


def _depends_on(jaxpr: core.Jaxpr, sources: Sequence[bool]) -> list[bool]:
  """For each output, whether it depends on an input marked in `sources`."""
  tainted = {v for v, s in zip(jaxpr.invars, sources) if s}
  for eqn in jaxpr.eqns:
    if any(isinstance(v, core.Var) and v in tainted for v in eqn.invars):
      tainted.update(eqn.outvars)
  return [isinstance(v, core.Var) and v in tainted for v in jaxpr.outvars]


# Primitives that multiply matrices: what W is for.
MATMULS = frozenset(("dot_general", "ragged_dot", "ragged_dot_general", "conv_general_dilated",
                     "pallas_call"))


def _matmul_after(bwd_jaxpr: core.Jaxpr, param_index: int, in_b: set[int]) -> bool:
  """Whether the gradient of parameter `param_index` (the backward's outputs
  are [dparams..., dx]) needs a matmul that B, which makes dx, does not run."""
  used = [i == param_index for i in range(len(bwd_jaxpr.outvars))]
  return any(e.primitive.name in MATMULS and id(e) not in in_b
             for e in core.dce(bwd_jaxpr, used)[0].eqns)


def _split_backward(bwd: core.ClosedJaxpr, n_params: int) -> tuple[Callable, Callable, list]:
  """The backward `bwd(residuals..., dy) -> [dparams..., dx]` as B
  `(residuals..., dy) -> [dx, cut...]` and W `(residuals..., cut...) ->
  dparams`, and the cut's variables: B keeps what dx needs; W runs the rest
  of what dparams needs, reading the values B made (and dy) from the cut."""
  bwd_jaxpr = bwd.jaxpr
  *residual_vars, dy_var = bwd_jaxpr.invars
  in_b = {id(e) for e in core.dce(bwd_jaxpr, [False] * n_params + [True])[0].eqns}
  # A weight whose gradient needs no matmul past what dx needs (a norm's
  # scale: a sum over the tokens) has it made in B, so that the cut holds the
  # small gradient, not the activations it sums.
  in_b_too = [not _matmul_after(bwd_jaxpr, i, in_b) for i in range(n_params)]
  b_jaxpr, _ = core.dce(bwd_jaxpr, [*in_b_too, True])
  w_all, _ = core.dce(bwd_jaxpr, [True] * n_params + [False])
  in_b = {id(e) for e in b_jaxpr.eqns}
  w_eqns = [e for e in w_all.eqns if id(e) not in in_b]
  defined_by_b = {v for e in b_jaxpr.eqns for v in e.outvars} | {dy_var}
  defined_by_w = {v for e in w_eqns for v in e.outvars}
  needed = [v for e in w_eqns for v in e.invars] + list(w_all.outvars)
  cut = list(dict.fromkeys(v for v in needed if isinstance(v, core.Var)
                           and v in defined_by_b and v not in defined_by_w))
  b_fn = core.jaxpr_as_fun(core.ClosedJaxpr(
      core.rebuilt(bwd_jaxpr, bwd_jaxpr.invars, [b_jaxpr.outvars[-1], *cut], b_jaxpr.eqns),
      bwd.consts))
  w_fn = core.jaxpr_as_fun(core.ClosedJaxpr(
      core.rebuilt(bwd_jaxpr, [*residual_vars, *cut], w_all.outvars, w_eqns), bwd.consts))
  return b_fn, w_fn, cut


def split_vjp(f: Callable[[Any, jax.Array, Any], jax.Array], params: Any,
              x: jax.Array, aux: Any) -> SplitVjp:
  """Splits the vjp of `f` at these (abstract or concrete) arguments.

  Traced where it will run (inside a `shard_map`, under the sharding rules
  the model uses), since the jaxprs capture the shapes and constraints.
  """
  params_leaves, params_tree = jax.tree.flatten(params)
  aux_leaves, aux_tree = jax.tree.flatten(aux)
  n_params, n_aux = len(params_leaves), len(aux_leaves)
  structure = {}

  def vjp_leaves(p_leaves, x, a_leaves):
    p = jax.tree.unflatten(params_tree, p_leaves)
    a = jax.tree.unflatten(aux_tree, a_leaves)
    y, vjp, stats = jax.vjp(lambda p, x: f(p, x, a), p, x, has_aux=True)
    residuals, structure["vjp"] = jax.tree.flatten(vjp)
    stats_leaves, structure["stats"] = jax.tree.flatten(stats)
    structure["n_stats"] = len(stats_leaves)
    return [y, *stats_leaves, *residuals]

  fwd = jax.make_jaxpr(vjp_leaves)(params_leaves, x, aux_leaves)
  fwd_jaxpr = fwd.jaxpr
  first_residual = 1 + structure["n_stats"]  # outputs: y, the stats, the residuals
  # Inputs are [params..., x, aux...]; a residual is stashed if it needs x.
  from_x = _depends_on(fwd_jaxpr, [False] * n_params + [True] + [False] * n_aux)
  stashed = from_x[first_residual:]
  y_aval = fwd_jaxpr.outvars[0].aval
  recompute_jaxpr, recompute_inputs = core.dce(
      fwd_jaxpr, [False] * first_residual + [not s for s in stashed])
  recompute = core.jaxpr_as_fun(core.ClosedJaxpr(recompute_jaxpr, fwd.consts))

  residual_avals = [v.aval for v in fwd_jaxpr.outvars[first_residual:]]
  bwd = _inline(jax.make_jaxpr(
      lambda res, dy: jax.tree.leaves(jax.tree.unflatten(structure["vjp"], res)(dy)))(
          residual_avals, y_aval))
  b_fn, w_fn, cut = _split_backward(bwd, n_params)
  x_aval = fwd_jaxpr.invars[n_params].aval

  def residuals(params, aux, stash):
    """The vjp's residuals: stashed ones and ones recomputed from params, aux."""
    # x is an input the recomputation never reads (dce keeps it in place).
    x_unused = jax.numpy.zeros(x_aval.shape, x_aval.dtype)
    varying = core.varying_axes(x_aval)
    if varying:
      x_unused = jax.lax.pcast(x_unused, varying, to="varying")
    args = [*jax.tree.leaves(params), x_unused, *jax.tree.leaves(aux)]
    recomputed = iter(recompute(*(a for a, u in zip(args, recompute_inputs) if u)))
    stash = iter(stash)
    return [next(stash) if s else next(recomputed) for s in stashed]

  def forward(params, x, aux):
    y, *rest = core.jaxpr_as_fun(fwd)(*jax.tree.leaves(params), x, *jax.tree.leaves(aux))
    stats = jax.tree.unflatten(structure["stats"], rest[:first_residual - 1])
    return y, [r for r, s in zip(rest[first_residual - 1:], stashed) if s], stats

  def backward_input(params, aux, stash, dy):
    dx, *cut_values = b_fn(*residuals(params, aux, stash), dy)
    return dx, cut_values

  def backward_weight(params, aux, stash, cut_values):
    return jax.tree.unflatten(params_tree, w_fn(*residuals(params, aux, stash), *cut_values))

  stats_avals = [v.aval for v in fwd_jaxpr.outvars[1:first_residual]]
  return SplitVjp(forward, backward_input, backward_weight,
                  stash=[_struct(a) for a, s in zip(residual_avals, stashed) if s],
                  cut=[_struct(v.aval) for v in cut],
                  stats=jax.tree.unflatten(structure["stats"], map(_struct, stats_avals)))


def _struct(aval) -> jax.ShapeDtypeStruct:
  return core.struct_of(aval)
