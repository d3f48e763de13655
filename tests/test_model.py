"""Model properties that sharding must not change and a trainer relies on."""

import re
import types

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import micro_config
from meshtrain.models.llama import Llama, rotary, vocab_logits
from meshtrain.parallel.attention import implementation_for
from meshtrain.train.loss import cross_entropy
from meshtrain.train.parallelize import model_config


def make(model=None, **overrides):
  cfg = micro_config()
  cfg.model.update(model or {})
  cfg.update(overrides)
  return Llama(model_config(cfg), rngs=nnx.Rngs(0))


def tokens(batch=2, length=16, seed=0):
  return jax.random.randint(jax.random.key(seed), (batch, length), 0, 64)


def test_causal_future_tokens_do_not_change_past_logits():
  model, x = make(), tokens()
  changed = x.at[:, 10:].set((x[:, 10:] + 1) % 64)
  np.testing.assert_allclose(model(x)[:, :10], model(changed)[:, :10], rtol=1e-6, atol=1e-6)
  assert not np.allclose(model(x)[:, 10:], model(changed)[:, 10:])


def test_rotary_scores_depend_only_on_relative_position():
  q, k = jax.random.normal(jax.random.key(1), (2, 1, 1, 1, 8))
  def score(i, j):
    pos = lambda p: jnp.full((1, 1), p)
    return jnp.sum(rotary(q, pos(i), 1e4) * rotary(k, pos(j), 1e4))
  np.testing.assert_allclose(score(5, 2), score(13, 10), rtol=1e-5)


def test_recomputation_keeps_gradients():
  x = tokens()
  def grads(remat):
    model = make(remat=remat)
    graphdef, params = nnx.split(model)
    def loss(p):
      return jnp.mean(nnx.merge(graphdef, p)(x) ** 2)
    return jax.grad(loss)(params)
  reference = grads("none")
  for remat in ("full", "selective"):
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7),
                 reference, grads(remat))


def test_bfloat16_compute_stays_close_to_float32():
  x = tokens()
  f32 = make()(x)
  bf16 = make(compute_dtype="bfloat16")(x)
  assert f32.dtype == bf16.dtype == jnp.float32  # logits always float32
  np.testing.assert_allclose(bf16, f32, atol=0.1)


def test_tied_embeddings_drop_the_output_head():
  def count(model):
    return sum(x.size for x in jax.tree.leaves(nnx.state(model)))
  untied, tied = make(), make(model=dict(tie_embeddings=True))
  assert count(untied) - count(tied) == 64 * 32
  assert tied(tokens()).shape == (2, 16, 64)


H100 = types.SimpleNamespace(platform="gpu", device_kind="NVIDIA H100 80GB HBM3")
MI300 = types.SimpleNamespace(platform="gpu", device_kind="AMD Instinct MI300X")


@pytest.mark.parametrize("requested, dtype, head_dim, device, expected", [
    ("", "bfloat16", 64, H100, "cudnn"),        # flash attention where it runs
    ("", "float32", 64, H100, "xla"),           # cuDNN's flash kernel is 16-bit only
    ("", "bfloat16", 160, H100, "xla"),         # head_dim over 128
    ("", "bfloat16", 60, H100, "xla"),          # head_dim not a multiple of 8
    ("", "bfloat16", 64, MI300, "xla"),         # no cuDNN
    ("", "bfloat16", 64, jax.devices()[0], "xla"),  # this CPU
    ("cudnn", "float32", 64, jax.devices()[0], "cudnn"),  # asked for: jax says if it cannot
])
def test_best_attention_is_flash_only_where_cudnn_runs_it(requested, dtype, head_dim, device,
                                                           expected):
  assert implementation_for(requested, dtype, head_dim, device) == expected


def _head_case(dtype):
  kx, kw = jax.random.split(jax.random.key(0))
  x_BxLxD = jax.random.normal(kx, (2, 4, 8)).astype(dtype)
  w_DxV = jax.random.normal(kw, (8, 16)).astype(dtype)
  targets_BxL = jnp.arange(8).reshape(2, 4)
  return x_BxLxD, w_DxV, targets_BxL


def _head_grads(logits_fn, targets_BxL):
  """(x, w) -> the loss's gradients with respect to the head's input and weight."""
  return jax.grad(lambda x, w: cross_entropy(logits_fn(x, w), targets_BxL), argnums=(0, 1))


def test_vocab_logits_gradients_are_autodiffs_in_float32():
  x, w, targets = _head_case(jnp.float32)
  chex.assert_trees_all_close(
      _head_grads(vocab_logits, targets)(x, w),
      _head_grads(lambda x, w: jnp.einsum("bld,dv->blv", x, w), targets)(x, w), rtol=1e-6)


def _matmul_operands(fn, *args) -> list[tuple[str, str]]:
  """The operand types of every matmul in the lowered program."""
  text = jax.jit(fn).lower(*args).as_text()
  return re.findall(r"stablehlo\.dot_general .*: \((tensor<[^>]*>), (tensor<[^>]*>)\)", text)


def test_bfloat16_logits_backward_multiplies_bfloat16():
  x, w, targets = _head_case(jnp.bfloat16)
  ours = _matmul_operands(_head_grads(vocab_logits, targets), x, w)
  assert len(ours) == 3 and all("bf16" in a and "bf16" in b for a, b in ours)
  # jax's own transpose of the same float32-output matmul takes the float32 gradient.
  plain = _matmul_operands(_head_grads(lambda x, w: jnp.einsum(
      "bld,dv->blv", x, w, preferred_element_type=jnp.float32), targets), x, w)
  assert sum("f32" in a or "f32" in b for a, b in plain) == 2
