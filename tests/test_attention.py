"""XLA attention that keeps its probabilities once equals jax's own attention,
values and gradients, for causal and document masks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from meshtrain.errors import ConfigError
from meshtrain.parallel import attention


def qkv(dtype=jnp.float32, batch=2, length=12, heads=4, kv_heads=2, head_dim=8):
  keys = jax.random.split(jax.random.key(0), 4)
  q = jax.random.normal(keys[0], (batch, length, heads, head_dim), dtype)
  k = jax.random.normal(keys[1], (batch, length, kv_heads, head_dim), dtype)
  v = jax.random.normal(keys[2], (batch, length, kv_heads, head_dim), dtype)
  cotangent = jax.random.normal(keys[3], q.shape, dtype)
  return q, k, v, cotangent


def value_and_grads(fn, q, k, v, cotangent):
  out, vjp = jax.vjp(fn, q, k, v)
  return out, vjp(cotangent)


SEGMENTS = np.array([[1, 1, 1, 2, 2, 2, 2, 3, 3, 0, 0, 0],
                     [1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2]], np.int32)


@pytest.mark.parametrize("segments", [False, True], ids=["causal", "documents"])
def test_equals_jax_attention_in_float32(segments):
  q, k, v, cotangent = qkv()
  segment_ids = jnp.asarray(SEGMENTS) if segments else None
  index = jnp.arange(q.shape[1])
  # jax's mask: [B, N, T, S] by explicit comparison, independent of causal_mask.
  mask = index[None, :] <= index[:, None]
  if segments:
    mask = mask[None] & (segment_ids[:, :, None] == segment_ids[:, None, :])
  reference = value_and_grads(
      lambda q, k, v: jax.nn.dot_product_attention(q, k, v, mask=jnp.broadcast_to(
          mask[:, None] if segments else mask, (2, 4, 12, 12)), implementation="xla"),
      q, k, v, cotangent)
  ours = value_and_grads(
      lambda q, k, v: attention.causal_attention(q, k, v, segment_ids_BxL=segment_ids),
      q, k, v, cotangent)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), ours, reference)


def test_bfloat16_stays_close_to_float32():
  q, k, v, cotangent = qkv()
  f32 = value_and_grads(attention.causal_attention, q, k, v, cotangent)
  bf16 = value_and_grads(attention.causal_attention,
                         *(x.astype(jnp.bfloat16) for x in (q, k, v, cotangent)))
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a.astype(jnp.float32), b, atol=0.1),
               bf16, f32)


def test_cudnn_refuses_documents_with_the_config_key():
  q, k, v, _ = qkv()
  with pytest.raises(ConfigError, match="config.attention.implementation"):
    attention.causal_attention(q, k, v, implementation="cudnn",
                               segment_ids_BxL=jnp.asarray(SEGMENTS))


@pytest.mark.parametrize("kv_heads", [2, 1], ids=["heads split", "kv heads whole"])
def test_attention_made_all_manual_equals_it_under_the_partitioner(kv_heads):
  """`all_manual` inside a partly manual shard_map (as Ulysses calls the flash
  kernel): the batch over `data`, the heads over `tensor` where the kv heads
  split too, each device attending alone; values and gradients as one device's."""
  from flax import nnx  # noqa: PLC0415
  from jax.sharding import PartitionSpec as P  # noqa: PLC0415

  from meshtrain.mesh import make_mesh  # noqa: PLC0415
  from meshtrain.rules import strategy_rules  # noqa: PLC0415
  mesh = make_mesh({"data": 2, "tensor": 2, "sequence": 2})
  q, k, v, cotangent = qkv(batch=4, kv_heads=kv_heads)
  attend = lambda q, k, v: attention.causal_attention(q, k, v)  # noqa: E731

  def partly_manual(q, k, v):
    return jax.shard_map(lambda *x: attention.all_manual(attend, *x), in_specs=P(),
                         out_specs=P(), axis_names={"sequence"})(q, k, v)

  with jax.set_mesh(mesh), nnx.logical_axis_rules(strategy_rules(mesh, 0).params):
    manual = jax.jit(lambda *x: value_and_grads(partly_manual, *x))(q, k, v, cotangent)
  expected = value_and_grads(attend, q, k, v, cotangent)
  for got, want in zip(jax.tree.leaves(manual), jax.tree.leaves(expected)):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
