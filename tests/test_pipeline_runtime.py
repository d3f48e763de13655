"""The shard_map pipeline executor against `jax.value_and_grad` of the plain
model, on several schedules and meshes, and its memory profile."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from conftest import micro_config
from meshtrain import rules as r
from meshtrain.analysis import hlo
from meshtrain.mesh import AXES, make_mesh
from meshtrain.models.llama import Llama, positions
from meshtrain.parallel.pipeline import runtime
from meshtrain.parallel.pipeline import schedule as sched
from meshtrain.parallel.pipeline.stages import StageLayout
from meshtrain.train.loss import cross_entropy
from meshtrain.train.parallelize import model_config


@functools.cache
def llama(num_layers: int):
  """The tiny Llama cut into the executor's three pieces (its own Embed,
  stacked blocks and Head), its params (already grouped as embed / layers /
  head) with their logical names, and the plain model's graphdef."""
  cfg = micro_config()
  cfg.model.num_layers = num_layers
  model = Llama(model_config(cfg), rngs=nnx.Rngs(0))
  graphdef, state = nnx.split(model)
  embed_def, layers_def, head_def = (nnx.graphdef(m) for m in (model.embed, model.layers, model.head))

  def embed_fn(p, tokens_BxL, aux):
    return nnx.merge(embed_def, p)(tokens_BxL)

  def layer_fn(p, x_BxLxD, aux):
    return nnx.merge(layers_def, p)(x_BxLxD, positions(x_BxLxD)), {}

  def loss_fn(p, x_BxLxD, aux):
    return cross_entropy(nnx.merge(head_def, p)(x_BxLxD), aux["targets"]), {}

  fns = dict(embed_fn=embed_fn, layer_fn=layer_fn, loss_fn=loss_fn)
  return fns, state.to_pure_dict(), r.logical_names(state), graphdef


_TOKENS = np.random.default_rng(0).integers(0, 64, (4, 4, 17), dtype=np.int32)
BATCH = (_TOKENS[:, :, :-1], _TOKENS[:, :, 1:])  # M = 4 microbatches of 4 sequences


@functools.cache
def reference(num_layers):
  """Loss and grads of the unpipelined model on BATCH: the mean of the
  microbatch losses."""
  _, params, _, graphdef = llama(num_layers)
  inputs_MxBxL, targets_MxBxL = BATCH

  def loss(p):
    model = nnx.merge(graphdef, p)
    per_mb = jax.vmap(lambda i, t: optax.softmax_cross_entropy_with_integer_labels(
        model(i), t).mean())
    return per_mb(inputs_MxBxL, targets_MxBxL).mean()
  return jax.jit(jax.value_and_grad(loss))(params)


def mesh_of(**sizes):
  sizes = {axis: sizes.get(axis, 1) for axis in AXES}
  return make_mesh(sizes, jax.devices()[:int(np.prod(list(sizes.values())))])


def counted(fns):
  """The pieces with a layer that reports each run: {"runs": 1}."""
  def layer_fn(p, x_BxLxD, aux):
    return fns["layer_fn"](p, x_BxLxD, aux)[0], {"runs": jnp.ones((), jnp.float32)}
  return {**fns, "layer_fn": layer_fn}


def executor(schedule, mesh, num_layers, batch_axes=(), layout=None):
  fns = llama(num_layers)[0]
  if layout is not None:
    fns = counted(fns)
  return jax.jit(lambda p, i, t: runtime.pipeline_loss_and_grads(
      schedule, mesh, **fns, params=p, microbatches={"inputs": i, "targets": t},
      batch_axes=batch_axes, layout=layout))


def run_sharded(schedule, mesh, num_layers, batch, batch_axes=(), layout=None):
  """Places params and batch by the mesh's rules and runs the executor with
  those rules in force (minus the manual batch axes) inside the model; with
  a `layout`, the layers in its slots (and each layer counting its runs)."""
  _, params, names, _ = llama(num_layers)
  if layout is not None:
    params = {**params, "layers": layout.to_slots(params["layers"])}
  rules = r.compose(*(r.AXIS_RULES[a] for a in AXES if mesh.shape[a] > 1))
  params = jax.device_put(params, r.tree_shardings(names, mesh, rules))
  batch_spec = PartitionSpec(None, *r.logical_to_spec((r.BATCH, r.LENGTH), rules))
  batch = jax.device_put(batch, NamedSharding(mesh, batch_spec))
  model_rules = tuple((name, tuple(a for a in axes if a not in batch_axes))
                      for name, axes in rules)
  with jax.set_mesh(mesh), nnx.logical_axis_rules(model_rules):
    compiled = executor(schedule, mesh, num_layers, batch_axes, layout).lower(
        params, *batch).compile()
    return compiled(params, *batch), compiled


def assert_matches(got, want):
  (loss, grads, stats, head_stats), (want_loss, want_grads) = got, want
  assert stats == head_stats == {}  # the dense layers and the head report no counts
  np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
  def close(path, g, w):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(w))),
                               err_msg=jax.tree_util.keystr(path))
  jax.tree_util.tree_map_with_path(close, jax.device_get(grads), jax.device_get(want_grads))


@pytest.mark.parametrize("name,num_chunks", [
    pytest.param("gpipe", 1, marks=pytest.mark.slow), ("1f1b", 1),
    pytest.param("interleaved_1f1b", 2, marks=pytest.mark.slow),
    pytest.param("zb_h1", 1, marks=pytest.mark.slow), ("zb_h2", 1)])
def test_schedules_match_plain_gradients(name, num_chunks):
  """Pipeline 4 x data 2, `data` left automatic: GSPMD composes with the
  executor (and reduces the gradients over `data` inside the ticks)."""
  schedule = sched.build(name, 4, 4, num_chunks)
  got, _ = run_sharded(schedule, mesh_of(pipeline=4, data=2), 4 * num_chunks, BATCH)
  assert_matches(got, reference(4 * num_chunks))


@pytest.mark.parametrize("name,counts", [
    ("1f1b", (1, 3, 2, 1)), pytest.param("gpipe", (2, 1, 1, 3), marks=pytest.mark.slow),
    pytest.param("interleaved_1f1b", (1, 2, 1, 1, 1, 1, 2, 1), marks=pytest.mark.slow),
    pytest.param("zb_h1", (3, 1, 1, 1), marks=pytest.mark.slow), ("zb_h2", (1, 2, 2, 1))])
def test_uneven_stages_match_plain_gradients(name, counts):
  """Chunks of different lengths (`StageLayout`): the gradients of the
  model's layers are the plain ones, the empty slots get exactly zero, and
  each layer runs once per microbatch (the empty slots never)."""
  layout = StageLayout(counts, 4)
  schedule = sched.build(name, 4, 4, layout.num_chunks)
  (loss, grads, stats, head_stats), _ = run_sharded(
      schedule, mesh_of(pipeline=4, data=2), sum(counts), BATCH, layout=layout)
  live = np.zeros(len(counts) * layout.slots, bool)
  live[layout.slot_of_layer()] = True
  np.testing.assert_array_equal(stats["runs"], np.where(live, 4.0, 0.0))
  for g in jax.tree.leaves(grads["layers"]):
    assert not np.any(np.asarray(g)[~live])
  grads = {**grads, "layers": layout.from_slots(grads["layers"])}
  assert_matches((loss, grads, {}, head_stats), reference(sum(counts)))


def test_manual_data_reduces_gradients_once_after_the_ticks():
  mesh = mesh_of(pipeline=2, tensor=2, data=2)
  got, compiled = run_sharded(sched.one_f_one_b(2, 4), mesh, 4, BATCH, batch_axes=("data",))
  assert_matches(got, reference(4))
  over_data = [c for c in hlo.collectives(compiled, mesh) if "data" in c.axis]
  assert over_data and not any(c.in_loop for c in over_data), over_data


def test_pipeline_by_tensor_and_fsdp():
  got, _ = run_sharded(sched.one_f_one_b(2, 4), mesh_of(pipeline=2, tensor=2, fsdp=2), 4, BATCH)
  assert_matches(got, reference(4))


@pytest.mark.slow
def test_one_f_one_b_memory_is_flat_in_microbatches():
  """Same microbatch, 4x the microbatches: the 1F1B stash stays at P - s
  microbatches' residuals (P = 2), GPipe's holds all M."""
  mesh, params = mesh_of(pipeline=2), llama(2)[1]
  temp = {}
  for name in ("gpipe", "1f1b"):
    for m in (4, 16):
      tokens = jax.ShapeDtypeStruct((m, 8, 16), jnp.int32)
      compiled = executor(sched.build(name, 2, m), mesh, 2).lower(params, tokens, tokens).compile()
      temp[name, m] = compiled.memory_analysis().temp_size_in_bytes
  stash_slot = 8 * 16 * 32 * 4  # one f32 x_BxLxD
  assert temp["1f1b", 16] <= 1.1 * temp["1f1b", 4], temp
  assert temp["gpipe", 16] - temp["gpipe", 4] >= (16 - 4) * stash_slot, temp

  # The last program, 1F1B at M = 16: activations only travel by permutes.
  pipeline_ops = [c for c in hlo.collectives(compiled, mesh) if c.axis == "pipeline"]
  kinds_in_loop = {c.kind for c in pipeline_ops if c.in_loop}
  assert kinds_in_loop == {"collective-permute"}, pipeline_ops
  assert not any(c.kind == "all-gather" for c in pipeline_ops), pipeline_ops
