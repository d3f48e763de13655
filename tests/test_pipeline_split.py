"""The backward split into B (input gradient) and W (weight gradient) against
`jax.vjp` of one Llama block, under every remat policy."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import micro_config
from meshtrain.models.llama import REMAT_POLICIES, Llama, positions
from meshtrain.parallel.pipeline.split import split_vjp
from meshtrain.train.parallelize import model_config


@functools.cache
def block():
  model = Llama(model_config(micro_config()), rngs=nnx.Rngs(0))
  params = jax.tree.map(lambda a: a[0], nnx.state(model.layers).to_pure_dict())
  return nnx.graphdef(model.layers), params


def layer_fn(remat):
  graphdef, _ = block()

  def layer(p, x, aux):
    """The block and a count it reports beside its output."""
    def f(p, x):
      y = nnx.merge(graphdef, p)(x, aux["positions"])
      return y, {"positive": jnp.sum(jax.lax.stop_gradient(y) > 0)}
    return f(p, x) if remat == "none" else jax.checkpoint(f, policy=REMAT_POLICIES[remat])(p, x)
  return layer


def dots(fn) -> int:
  return len(re.findall(r"\bdot_general\b", str(jax.make_jaxpr(fn)())))


@pytest.mark.parametrize("remat", ["none", "selective", "full"])
def test_b_and_w_equal_the_vjp_and_share_no_matmul(remat):
  _, params = block()
  layer = layer_fn(remat)
  x = jax.random.normal(jax.random.key(1), (2, 16, 32))
  aux = {"positions": positions(x)}
  split = split_vjp(layer, params, x, aux)
  dy = jax.random.normal(jax.random.key(2), x.shape)

  @jax.jit
  def run(params, x, dy):
    y, stash, stats = split.forward(params, x, aux)
    dx, cut = split.backward_input(params, aux, stash, dy)
    want_y, vjp, want_stats = jax.vjp(lambda p, x: layer(p, x, aux), params, x, has_aux=True)
    return ((y, stats, dx, split.backward_weight(params, aux, stash, cut)),
            (want_y, want_stats, *vjp(dy)[::-1]))

  (y, stats, dx, d_params), (want_y, want_stats, want_dx, want_d_params) = run(params, x, dy)
  stash = jax.eval_shape(lambda: split.forward(params, x, aux)[1])
  cut = jax.eval_shape(lambda: split.backward_input(params, aux, stash, dy)[1])
  np.testing.assert_array_equal(y, want_y)
  assert int(stats["positive"]) == int(want_stats["positive"]) and split.stats["positive"].shape == ()
  np.testing.assert_allclose(dx, want_dx, rtol=1e-6, atol=1e-6)
  jax.tree.map(lambda g, w: np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6),
               d_params, want_d_params)
  # B and W together run exactly the backward's matmuls: neither recomputes the other's.
  backward = dots(lambda: jax.vjp(lambda p, x: layer(p, x, aux), params, x,
                                  has_aux=True)[1](dy)) - dots(
      lambda: layer(params, x, aux))
  assert dots(lambda: split.backward_input(params, aux, stash, dy)) + dots(
      lambda: split.backward_weight(params, aux, stash, cut)) == backward
  # The norms' scales get their gradients in B (sums over the tokens): the cut
  # holds those, not the activations and per-token statistics they sum.
  assert sorted(c.shape for c in split.cut if len(c.shape) == 1) == [(32,), (32,)], split.cut
  assert not any(c.shape[-1] == 1 for c in split.cut), split.cut
  # The stash holds x-dependent residuals only: weights and rotary tables are recomputed.
  assert all(s.shape[:2] == (2, 16) or s.shape[0] == 2 for s in split.stash), split.stash
  if remat == "full":
    assert [s.shape for s in split.stash] == [x.shape]
