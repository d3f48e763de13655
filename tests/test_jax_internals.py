"""Each behaviour meshtrain takes from jax's internals (`meshtrain.jax_internals`),
checked on its own: a jax upgrade that changes one fails here by name."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from meshtrain import jax_internals as internals
from meshtrain.mesh import make_mesh


def _equation(fn, *args, primitive: str):
  """The first equation of `primitive` in `fn`'s jaxpr."""
  eqn = next((e for e in jax.make_jaxpr(fn)(*args).jaxpr.eqns if e.primitive.name == primitive),
             None)
  assert eqn is not None, f"{primitive} not found"
  return eqn


X = jnp.ones((4, 6))
# One function per primitive whose parameters planner/residuals.py reads.
PRODUCERS = {
    "dot_general": lambda: (lambda a: jnp.einsum("ij,kj->ik", a, a), X),
    "transpose": lambda: (lambda a: a.T, X),
    "broadcast_in_dim": lambda: (lambda a: jnp.broadcast_to(a[:, None], (4, 2, 6)), X),
    "squeeze": lambda: (lambda a: a[:1].squeeze(0), X),
    "reduce_sum": lambda: (lambda a: a.sum(0), X),
    "reduce_max": lambda: (lambda a: a.max(1), X),
    "argmax": lambda: (lambda a: jnp.argmax(a, 0), X),
    "stack": lambda: (lambda a: jnp.stack([a, a], 1), X),
    "concatenate": lambda: (lambda a: jnp.concatenate([a, a], 1), X),
    "split": lambda: (lambda a: jnp.split(a, 2, 0), X),
    "scan": lambda: (lambda a: jax.lax.scan(lambda c, x: (c + x, x), a[0], a), X),
    "while": lambda: (lambda a: jax.lax.while_loop(lambda c: c[0, 0] < 3, lambda c: c + 1, a), X),
    "cond": lambda: (lambda a: jax.lax.cond(a[0, 0] > 0, jnp.sin, jnp.cos, a), X),
    "sharding_constraint": lambda: (
        lambda a: jax.lax.with_sharding_constraint(a, P("data")), X),
    "shard_map": lambda: (lambda a: jax.shard_map(lambda b: b * 2, in_specs=P("data"),
                                                  out_specs=P("data"), axis_names={"data"})(a),
                          X),
}


def test_every_primitive_meshtrain_reads_is_listed_with_a_producer():
  assert set(PRODUCERS) == set(internals.PARAMS)


@pytest.mark.parametrize("primitive", sorted(internals.PARAMS))
def test_primitive_parameters_are_there(primitive):
  fn, arg = PRODUCERS[primitive]()
  with jax.set_mesh(make_mesh({"data": 2}, jax.devices()[:2])):
    eqn = _equation(fn, arg, primitive=primitive)
  for name in internals.PARAMS[primitive]:
    internals.param(eqn, name)  # raises KeyError where jax renamed it
  if primitive == "dot_general":
    (lc, rc), (lb, rb) = internals.param(eqn, "dimension_numbers")
    assert (tuple(lc), tuple(rc), tuple(lb), tuple(rb)) == ((1,), (1,), (), ())
  if primitive == "scan":
    assert internals.param(eqn, "num_consts") == 0 and internals.param(eqn, "num_carry") == 1
    assert isinstance(internals.param(eqn, "jaxpr"), internals.ClosedJaxpr)
  if primitive == "shard_map":
    assert set(internals.param(eqn, "newly_manual_axes")) == {"data"}
    assert isinstance(internals.param(eqn, "jaxpr"), internals.Jaxpr)


@pytest.mark.parametrize("wrap, name", [(jax.jit, "jit"), (jax.checkpoint, "remat2")])
def test_calls_keep_their_body_where_calls_says(wrap, name):
  eqn = _equation(wrap(jnp.sin), X, primitive=name)
  body = internals.call_body(eqn)
  body = body.jaxpr if isinstance(body, internals.ClosedJaxpr) else body
  assert [e.primitive.name for e in body.eqns] == ["sin"]


def test_replay_runs_an_equation_as_traced():
  closed = jax.make_jaxpr(lambda a: jnp.einsum("ij,kj->ik", a, a) + 1)(X)
  env = dict(zip(closed.jaxpr.invars, [X]))
  for eqn in closed.jaxpr.eqns:
    values = [v.val if isinstance(v, internals.Literal) else env[v] for v in eqn.invars]
    env.update(zip(eqn.outvars, internals.replay(eqn, values)))
  np.testing.assert_allclose(env[closed.jaxpr.outvars[0]], X @ X.T + 1)


def test_dce_cuts_to_the_used_outputs_and_keeps_the_inputs_in_place():
  closed = jax.make_jaxpr(lambda a, b: (jnp.sin(a), jnp.cos(b)))(X, X)
  cut, kept_inputs = internals.dce(closed.jaxpr, [False, True])
  assert kept_inputs == [True, True] and len(cut.invars) == 2
  assert [e.primitive.name for e in cut.eqns] == ["cos"]


def test_rebuilt_jaxpr_of_some_equations_runs():
  closed = jax.make_jaxpr(lambda a: jnp.cos(jnp.sin(a)))(X)
  sin, cos = closed.jaxpr.eqns
  tail = internals.rebuilt(closed.jaxpr, sin.outvars, cos.outvars, [cos])
  out, = internals.jaxpr_as_fun(internals.ClosedJaxpr(tail, closed.consts))(X)
  np.testing.assert_allclose(out, jnp.cos(X))


def test_vjp_backward_is_a_pytree_of_its_residuals():
  """pipeline/split.py stashes the leaves of `jax.vjp`'s backward."""
  _, backward = jax.vjp(lambda a: jnp.sin(a) * a, X)
  leaves, tree = jax.tree.flatten(backward)
  assert leaves and all(isinstance(x, jax.Array) for x in leaves)
  rebuilt = jax.tree.unflatten(tree, leaves)
  np.testing.assert_allclose(rebuilt(jnp.ones_like(X))[0], backward(jnp.ones_like(X))[0])


def test_varying_axes_inside_a_shard_map():
  mesh = make_mesh({"data": 2, "tensor": 2}, jax.devices()[:4])
  seen = {}

  @functools.partial(jax.shard_map, mesh=mesh, in_specs=P("data"), out_specs=P("data"),
                     axis_names={"data", "tensor"})
  def body(a):
    seen["input"] = internals.varying_axes(a)
    zero = jnp.zeros(())
    seen["constant"] = internals.varying_axes(zero)
    cast = jax.lax.pcast(zero, ("tensor",), to="varying")
    seen["cast"] = internals.varying_axes(cast)
    seen["aval"] = internals.varying_axes(jax.make_jaxpr(lambda: a)().jaxpr.outvars[0].aval)
    return a

  jax.jit(body)(X)
  assert seen == {"input": ("data",), "constant": (), "cast": ("tensor",), "aval": ("data",)}
