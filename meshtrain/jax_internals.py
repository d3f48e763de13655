"""What meshtrain relies on of jax beyond its documented API, in one place.

Each behaviour below has a test in tests/test_jax_internals.py, and
pyproject.toml bounds jax to the minor version those tests pass on (0.10), so
an upgrade that changes one fails there first, by name, not deep in a step.

  jaxprs        their types (`jax.extend.core`), dead-code elimination
                (`jax._src`), replaying an equation and rebuilding a jaxpr
                from some of its equations: pipeline/split.py cuts a layer's
                backward into B and W with them.
  parameters    what planner/residuals.py reads of primitives' parameters to
                carry layouts through a jaxpr (`param`, `PARAMS`).
  varying axes  which manual axes a value inside a `shard_map` varies over
                (`varying_axes`, `struct_of`): the pipeline types its
                branches' outputs and its stash buffers as their values are.
  distributed   the module where `jax.distributed` keeps its client and
                reaches jaxlib to start the coordination service
                (`jax_distributed`, whose `_jax` distributed.py stands in for
                while process 0 starts the service in a child process), and
                jaxlib's own (`jaxlib_runtime`).
"""

from collections.abc import Sequence
from typing import Any

import jax
from jax._src import distributed as jax_distributed
from jax._src.interpreters import partial_eval as _partial_eval
from jax._src.lib import _jax as jaxlib_runtime
from jax.extend.core import ClosedJaxpr, Jaxpr, JaxprEqn, Literal, Var, jaxpr_as_fun

__all__ = ["CALLS", "PARAMS", "ClosedJaxpr", "Jaxpr", "Literal", "Var", "call_body", "dce",
           "jax_distributed", "jaxlib_runtime", "jaxpr_as_fun", "param", "rebuilt", "replay",
           "struct_of", "varying_axes"]

# Call-like primitives and the parameter that holds their body.
CALLS = {**{name: "jaxpr" for name in ("jit", "pjit", "closed_call", "core_call", "checkpoint",
                                       "remat", "remat2")},
         "custom_jvp_call": "call_jaxpr", "custom_vjp_call": "call_jaxpr"}

# The parameters read of each primitive, by name.
PARAMS = {
    "dot_general": ("dimension_numbers",),  # ((lhs contract, rhs contract), (lhs batch, rhs batch))
    "transpose": ("permutation",),
    "broadcast_in_dim": ("broadcast_dimensions",),
    "squeeze": ("dimensions",),
    "reduce_sum": ("axes",),
    "reduce_max": ("axes",),
    "argmax": ("axes",),
    "stack": ("axis",),
    "concatenate": ("dimension",),
    "split": ("axis",),
    "scan": ("jaxpr", "num_consts", "num_carry"),
    "while": ("cond_nconsts", "body_nconsts"),
    "cond": ("branches",),
    "shard_map": ("jaxpr", "newly_manual_axes", "out_specs"),
    "sharding_constraint": ("sharding", "unconstrained_dims"),
}
_MISSING = object()


def param(eqn: JaxprEqn, name: str, default: Any = _MISSING) -> Any:
  """`eqn`'s parameter `name`; `default` where the equation lacks it."""
  if default is _MISSING:
    return eqn.params[name]
  return eqn.params.get(name, default)


def call_body(eqn: JaxprEqn) -> ClosedJaxpr | Jaxpr | None:
  """The body of a call-like equation (`CALLS`), else None."""
  key = CALLS.get(eqn.primitive.name)
  return None if key is None else eqn.params[key]


def replay(eqn: JaxprEqn, values: Sequence[Any]) -> list[Any]:
  """Runs one equation on `values` as it ran when traced (its parameters and
  context, such as the mesh and manual axes)."""
  with eqn.ctx.manager:
    outs = eqn.primitive.bind(*values, **eqn.primitive.get_bind_params(eqn.params))
  return list(outs) if eqn.primitive.multiple_results else [outs]


def dce(jaxpr: Jaxpr, used_outputs: Sequence[bool]) -> tuple[Jaxpr, list[bool]]:
  """`jaxpr` cut to the used outputs, its inputs all kept in place, and which
  inputs the cut jaxpr takes (all of them)."""
  return _partial_eval.dce_jaxpr(jaxpr, list(used_outputs), instantiate=True)


def rebuilt(jaxpr: Jaxpr, invars: Sequence[Var], outvars: Sequence[Any],
            eqns: Sequence[JaxprEqn]) -> Jaxpr:
  """A jaxpr of some of `jaxpr`'s equations, between other inputs and outputs."""
  debug_info = jaxpr.debug_info._replace(arg_names=None, result_paths=None)
  return Jaxpr(jaxpr.constvars, list(invars), list(outvars), list(eqns), jaxpr.effects,
               debug_info)


def struct_of(aval: jax.core.ShapedArray) -> jax.ShapeDtypeStruct:
  """The shape, dtype and varying manual axes of an abstract value."""
  return jax.ShapeDtypeStruct(aval.shape, aval.dtype, manual_axis_type=aval.manual_axis_type)


def varying_axes(x: Any) -> tuple[str, ...]:
  """The manual mesh axes a value (or abstract value) inside a `shard_map` varies over."""
  if isinstance(x, jax.ShapeDtypeStruct):
    return tuple(x.manual_axis_type.varying) if x.manual_axis_type is not None else ()
  aval = x if isinstance(x, jax.core.ShapedArray) else jax.typeof(x)
  return tuple(aval.manual_axis_type.varying)
