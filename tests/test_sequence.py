"""Context-parallel attention equals plain causal attention, values and
gradients, and runs the collectives its strategy names over `sequence` only."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from meshtrain import rules as r
from meshtrain.analysis import hlo
from meshtrain.mesh import make_mesh
from meshtrain.parallel import attention
from meshtrain.parallel import sequence
from meshtrain.parallel.sequence import STRATEGIES, sequence_attention

# What each strategy runs, forward and backward (a gather's transpose reduce-scatters).
COLLECTIVES = {"all_gather_kv": {"all-gather", "reduce-scatter"}, "ulysses": {"all-to-all"},
               "ring": {"collective-permute"}}


def mesh_of(**sizes):
  """A mesh of these axis sizes over the first devices (the others left out)."""
  devices = jax.devices()[:math.prod(sizes.values())]
  return make_mesh({"data": 1, "pipeline": 1, "fsdp": 1, "sequence": 1, "tensor": 1, **sizes},
                   devices)


def qkv(batch=2, length=32, heads=4, kv_heads=2, head_dim=8):
  kq, kk, kv, kc = jax.random.split(jax.random.key(0), 4)
  q_BxLxNxH = jax.random.normal(kq, (batch, length, heads, head_dim))
  k_BxLxKxH = jax.random.normal(kk, (batch, length, kv_heads, head_dim))
  v_BxLxKxH = jax.random.normal(kv, (batch, length, kv_heads, head_dim))
  cotangent_BxLxNxH = jax.random.normal(kc, q_BxLxNxH.shape)
  return q_BxLxNxH, k_BxLxKxH, v_BxLxKxH, cotangent_BxLxNxH


def output_and_grads(attention, q, k, v, cotangent):
  out, vjp = jax.vjp(attention, q, k, v)
  return out, vjp(cotangent)


CASES = [
    # strategy, mesh sizes, spec of q, k, v (batch, length, heads, head_dim), heads, kv heads
    *[(s, {"sequence": 4}, P(None, "sequence"), 4, 2) for s in STRATEGIES],
    *[(s, {"data": 2, "sequence": 4}, P("data", "sequence"), 4, 2) for s in STRATEGIES],
    ("all_gather_kv", {"sequence": 4, "tensor": 2}, P(None, "sequence", "tensor"), 4, 2),
    ("ring", {"sequence": 4, "tensor": 2}, P(None, "sequence", "tensor"), 4, 2),
    # Two kv heads over 4 x 2 devices: repeated to 8 to keep the tensor split.
    ("ulysses", {"sequence": 4, "tensor": 2}, P(None, "sequence", "tensor"), 8, 2),
    # One kv head for 8 devices: repeated to 8.
    ("ulysses", {"sequence": 8}, P(None, "sequence"), 8, 1),
]


@pytest.mark.parametrize("strategy,sizes,spec,heads,kv_heads", [
    # the first of each strategy in the quick tier
    pytest.param(*c, id=f"{c[0]}-{'x'.join(f'{a}{n}' for a, n in c[1].items())}",
                 marks=() if i < len(STRATEGIES) else pytest.mark.slow)
    for i, c in enumerate(CASES)])
def test_equals_causal_attention_and_keeps_other_axes(strategy, sizes, spec, heads, kv_heads):
  mesh = mesh_of(**sizes)
  q, k, v, cotangent = qkv(heads=heads, kv_heads=kv_heads)
  expected_out, expected_grads = output_and_grads(
      functools.partial(jax.nn.dot_product_attention, is_causal=True), q, k, v, cotangent)

  sharding = NamedSharding(mesh, spec)
  attention = functools.partial(sequence_attention, strategy=strategy, mesh=mesh)
  step = jax.jit(functools.partial(output_and_grads, attention),
                 out_shardings=(sharding, (sharding,) * 3))
  with jax.set_mesh(mesh):
    args = jax.device_put((q, k, v, cotangent), sharding)
    compiled = step.lower(*args).compile()
    out, grads = compiled(*args)

  np.testing.assert_allclose(out, expected_out, rtol=1e-5, atol=1e-5)
  for grad, expected in zip(grads, expected_grads):
    np.testing.assert_allclose(grad, expected, rtol=1e-5, atol=1e-5)
  # Batch (data) and head (tensor) sharding stay automatic: no collective
  # gathers them, every one runs over `sequence`.
  collectives = hlo.collectives(compiled, mesh)
  assert {c.axis for c in collectives} == {"sequence"}, collectives
  assert {c.kind for c in collectives} == COLLECTIVES[strategy], collectives


def test_ulysses_runs_the_flash_kernel_on_each_devices_heads_over_the_whole_length(monkeypatch):
  """With `implementation="cudnn"` Ulysses hands each device's heads of the
  whole length to cuDNN's flash attention (`jax.nn.dot_product_attention`,
  causal): here that call is recorded and run by XLA (the CPU has no cuDNN),
  and the result equals plain causal attention. all_gather_kv's local queries
  and the ring's blocks stay on XLA's masked attention."""
  mesh = mesh_of(data=2, sequence=4)
  q, k, v, cotangent = qkv(heads=8, kv_heads=2)
  plain = jax.nn.dot_product_attention
  expected_out, expected_grads = output_and_grads(
      functools.partial(plain, is_causal=True), q, k, v, cotangent)
  calls = []

  def flash(q_BxLxNxH, k_BxLxKxH, v_BxLxKxH, *, is_causal, local_window_size, implementation):
    calls.append((q_BxLxNxH.shape, k_BxLxKxH.shape, is_causal, implementation))
    return plain(q_BxLxNxH, k_BxLxKxH, v_BxLxKxH, is_causal=is_causal,
                 local_window_size=local_window_size, implementation="xla")

  monkeypatch.setattr(jax.nn, "dot_product_attention", flash)
  sharding = NamedSharding(mesh, P("data", "sequence"))
  for strategy in STRATEGIES:
    calls.clear()
    attend = functools.partial(sequence_attention, strategy=strategy, mesh=mesh,
                               implementation="cudnn")
    with jax.set_mesh(mesh):
      out, grads = jax.jit(functools.partial(output_and_grads, attend))(
          *jax.device_put((q, k, v, cotangent), sharding))
    np.testing.assert_allclose(out, expected_out, rtol=1e-5, atol=1e-5)
    for grad, expected in zip(grads, expected_grads):
      np.testing.assert_allclose(grad, expected, rtol=1e-5, atol=1e-5)
    if strategy == "ulysses":  # one row, 32 tokens, 2 of 8 query heads with their kv head
      assert set(calls) == {((1, 32, 2, 8), (1, 32, 1, 8), True, "cudnn")}, calls
    else:
      assert not calls, (strategy, calls)


def test_one_device_axis_is_plain_attention():
  mesh = mesh_of(data=8)
  q, k, v, _ = qkv()
  for strategy in STRATEGIES:
    np.testing.assert_allclose(
        sequence_attention(q, k, v, strategy=strategy, mesh=mesh),
        jax.nn.dot_product_attention(q, k, v, is_causal=True), rtol=1e-6, atol=1e-6)


# Documents of 5, 12 and 13 tokens and 2 of padding; one of 20 and one of 12.
SEGMENTS_2x32 = np.array([[1] * 5 + [2] * 12 + [3] * 13 + [0] * 2, [1] * 20 + [2] * 12], np.int32)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_packed_documents_equal_one_device(strategy):
  """With segment ids every strategy equals one device's document-masked
  attention; on 4 devices ring meets blocks that hide every key from a query."""
  mesh = mesh_of(data=2, sequence=4)

  def attend(q, k, v, segment_ids):
    return sequence_attention(q, k, v, strategy=strategy, mesh=mesh, segment_ids_BxL=segment_ids)

  def run(*args):
    with jax.set_mesh(mesh):
      args = jax.device_put(args, NamedSharding(mesh, P("data", "sequence")))
      return jax.jit(lambda q, k, v, g, s: output_and_grads(
          functools.partial(attend, segment_ids=s), q, k, v, g))(*args)
  assert_packed_attention_equals_one_device(run)


def assert_packed_attention_equals_one_device(run):
  """`run(q, k, v, cotangent, segment_ids)` -> (out, grads) equal one device's."""
  q, k, v, cotangent = qkv()
  segment_ids = jnp.asarray(SEGMENTS_2x32)
  expected_out, expected_grads = output_and_grads(
      functools.partial(attention.causal_attention, segment_ids_BxL=segment_ids), q, k, v,
      cotangent)
  out, grads = run(q, k, v, cotangent, segment_ids)
  np.testing.assert_allclose(out, expected_out, rtol=1e-5, atol=1e-5)
  for grad, expected in zip(grads, expected_grads):
    np.testing.assert_allclose(grad, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_inside_a_shard_map_already_manual_over_sequence(strategy):
  """The pipeline runs its layers manual over `sequence` (and `pipeline`, with
  `data`): each strategy then makes its collectives on the local shards. Values
  and gradients equal one device's, with packed documents."""
  mesh = mesh_of(pipeline=2, sequence=4)

  def local(q, k, v, g, s):
    attend = functools.partial(sequence_attention, strategy=strategy, segment_ids_BxL=s,
                               mesh=jax.sharding.get_abstract_mesh())
    return output_and_grads(attend, q, k, v, g)

  def run(*args):
    by_length = P(None, "sequence")
    with jax.set_mesh(mesh):
      return jax.jit(jax.shard_map(local, mesh=mesh, in_specs=by_length, out_specs=by_length,
                                   axis_names={"pipeline", "sequence"}, check_vma=False))(*args)
  assert_packed_attention_equals_one_device(run)


def test_ulysses_names_what_to_change():
  q, k, v, _ = qkv(heads=6, kv_heads=2)
  with pytest.raises(ValueError, match="set num_heads to a multiple of 4 or change mesh.sequence"):
    sequence_attention(q, k, v, strategy="ulysses", mesh=mesh_of(sequence=4, data=2))


def test_rejects_unknown_strategy_bad_groups_and_lengths():
  q, k, v, _ = qkv(heads=4, kv_heads=3)
  mesh = mesh_of(sequence=4, data=2)
  with pytest.raises(ValueError, match="choose one of all_gather_kv, ulysses, ring"):
    sequence_attention(q, k, v, strategy="striped", mesh=mesh)
  with pytest.raises(ValueError, match="not a multiple of 3 kv heads"):
    sequence_attention(q, k, v, strategy="ring", mesh=mesh)
  q, k, v, _ = qkv(length=36)
  with pytest.raises(ValueError, match=r"needs the length \(36\) to be a multiple of 8"):
    sequence_attention(q, k, v, strategy="ring", mesh=mesh)


def test_ring_zigzag_layout():
  """After the re-layout device i holds chunks i and 2n-1-i."""
  n = 4
  mesh = mesh_of(sequence=n, data=2)
  positions_1xLx1x1 = jnp.arange(2 * n * 3)[None, :, None, None]  # chunks of 3 tokens
  with jax.set_mesh(mesh):
    zigzag = jax.jit(functools.partial(sequence.to_zigzag, mesh=mesh))(positions_1xLx1x1)
  chunks = np.asarray(zigzag).reshape(2 * n, 3)[:, 0] // 3
  np.testing.assert_array_equal(chunks, [0, 7, 1, 6, 2, 5, 3, 4])
  np.testing.assert_array_equal(zigzag.reshape(-1), sequence.zigzag_order(2 * n * 3, n))


def test_ring_on_zigzag_inputs_skips_the_relayouts():
  """What the model does under ring: q, k, v arrive in zigzag order and the
  output stays so; only the ring's own K/V sends remain."""
  n = 4
  mesh = mesh_of(sequence=n, data=2)
  q, k, v, cotangent = qkv()
  expected_out, expected_grads = output_and_grads(
      functools.partial(jax.nn.dot_product_attention, is_causal=True), q, k, v, cotangent)
  order = sequence.zigzag_order(q.shape[1], n)

  def attention(q, k, v):
    return sequence.sequence_attention(q, k, v, strategy="ring", mesh=mesh, zigzag=True)

  sharding = NamedSharding(mesh, P("data", "sequence"))
  with jax.set_mesh(mesh):
    args = jax.device_put([x[:, order] for x in (q, k, v, cotangent)], sharding)
    compiled = jax.jit(functools.partial(output_and_grads, attention)).lower(*args).compile()
    out, grads = compiled(*args)
  np.testing.assert_allclose(out, expected_out[:, order], rtol=1e-5, atol=1e-5)
  for grad, expected in zip(grads, expected_grads):
    np.testing.assert_allclose(grad, expected[:, order], rtol=1e-5, atol=1e-5)
  # n - 1 sends of K and V forward and of their gradients backward, nothing else.
  permutes = [c for c in hlo.collectives(compiled, mesh) if c.kind == "collective-permute"]
  assert sum(c.count for c in permutes) == 2 * (n - 1)
  with pytest.raises(ValueError, match="only the ring strategy takes the zigzag layout"):
    sequence.sequence_attention(q, k, v, strategy="ulysses", mesh=mesh, zigzag=True)


@pytest.mark.parametrize("n, tensor, zigzag", [(n, t, z) for n in (2, 4) for t in (1, 2)
                                                for z in (False, True)])
def test_count_before_is_a_prefix_sum_in_position_order(n, tensor, zigzag):
  """An MoE capacity's count (`count_before`): per token, the sum over the
  earlier positions of its sequence, in position order however the length
  lies: split over `sequence` (and `tensor`, by Megatron-SP's rules), in the
  ring's zigzag order, or one device's shard inside a shard_map manual over
  `sequence` (the pipeline's). Only the chunks' [B, chunks, E] totals cross
  devices, gathered along the length."""
  b, length, e = 4, 16, 8
  x_BxLxE = np.random.default_rng(0).integers(0, 3, (b, length, e)).astype(np.int32)
  expected = np.cumsum(x_BxLxE, axis=1) - x_BxLxE
  mesh = mesh_of(sequence=n, tensor=tensor)
  rules = r.strategy_rules(mesh, tensor_sequence_parallel=tensor > 1)
  order = sequence.zigzag_order(length, n) if zigzag else np.arange(length)
  count = functools.partial(sequence.count_before, zigzag=zigzag)
  manual = jax.shard_map(lambda x: count(x)[0], mesh=mesh, in_specs=P(None, "sequence"),
                         out_specs=P(None, "sequence"), axis_names={"sequence"})
  split = r.logical_to_spec((r.BATCH, r.RES_LENGTH, None), rules.params)
  with jax.set_mesh(mesh), nnx.logical_axis_rules(rules.params):
    assert count(jnp.asarray(x_BxLxE))[1] == length
    for fn, spec in ((lambda x: count(x)[0], split), (manual, P(None, "sequence"))):
      x = jax.device_put(x_BxLxE[:, order], NamedSharding(mesh, spec))
      compiled = jax.jit(fn).lower(x).compile()
      np.testing.assert_array_equal(compiled(x), expected[:, order])
      collectives = hlo.collectives(compiled, mesh)
      assert {c.kind for c in collectives} == {"all-gather"}, collectives
      chunks = sequence.prefix_chunks(length, n * tensor, n if zigzag else 0)
      assert sum(c.bytes for c in collectives) <= 4 * b * chunks * e, collectives
