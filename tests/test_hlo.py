"""Tests for meshtrain.analysis.hlo on 8 simulated CPU devices."""

import jax

try:
  jax.config.update("jax_num_cpu_devices", 8)
except RuntimeError:  # the backend is already up, e.g. started by conftest
  pass

import math

import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import op_trace
from meshtrain.analysis import hlo

MESH_2x4 = ((2, 4), ("data", "fsdp"))
MESH_2x2x2 = ((2, 2, 2), ("data", "fsdp", "tensor"))
F32 = 4


def make_mesh(shape: tuple[int, ...], names: tuple[str, ...],
              order: list[int] | None = None) -> Mesh:
  """A mesh over the 8 CPU devices, optionally listed in `order`."""
  devices = np.array(jax.devices()[:8])
  if order is not None:
    devices = devices[order]
  return Mesh(devices.reshape(shape), names)


def compile_shard_map(mesh: Mesh, fn, x: jax.Array, in_spec: P, out_spec: P):
  """Compiles `fn` as a shard_map; no vma check, so out specs may replicate."""
  mapped = jax.shard_map(fn, mesh=mesh, in_specs=in_spec, out_specs=out_spec,
                         check_vma=False)
  return jax.jit(mapped).lower(x).compile()


def block_bytes(mesh: Mesh, shape: tuple[int, ...], spec: P) -> int:
  """Per-device bytes of an f32 array of `shape` sharded by `spec`."""
  return math.prod(NamedSharding(mesh, spec).shard_shape(shape)) * F32


def only(items: list):
  """The single element of `items`."""
  assert len(items) == 1, items
  return items[0]


# Every axis of both meshes, e.g. id "2x4-fsdp".
MESH_AXES = [
    pytest.param(shape, names, axis, id="x".join(map(str, shape)) + f"-{axis}")
    for shape, names in (MESH_2x4, MESH_2x2x2)
    for axis in names
]


# ------------------------------------------------------- shard_map collectives


@pytest.mark.parametrize("shape,names,axis", MESH_AXES)
def test_psum_is_all_reduce_on_its_axis(shape, names, axis):
  mesh = make_mesh(shape, names)
  spec = P(names)  # every device holds a different block of rows
  x = jnp.ones((16, 8), jnp.float32)
  compiled = compile_shard_map(mesh, lambda a: lax.psum(a, axis), x, spec,
                               spec)
  n, block = mesh.shape[axis], block_bytes(mesh, x.shape, spec)
  assert hlo.collectives(compiled, mesh) == [
      hlo.Collective("all-reduce", axis, 1, 2 * block * (n - 1) // n, False)
  ]


def test_psum_over_two_axes_names_them_in_mesh_order():
  mesh = make_mesh(*MESH_2x2x2)
  x = jnp.ones((16, 8), jnp.float32)
  compiled = compile_shard_map(mesh, lambda a: lax.psum(a, ("tensor", "data")),
                               x, P(("data", "fsdp", "tensor")), P())
  op = only(hlo.collective_ops(compiled, mesh))
  assert (op.kind, op.axis, op.group_size) == ("all-reduce", "data+tensor", 4)
  assert op.bytes == 2 * (2 * 8 * F32) * 3 // 4


@pytest.mark.parametrize("shape,names,axis", MESH_AXES)
def test_psum_scatter_is_reduce_scatter(shape, names, axis):
  mesh = make_mesh(shape, names)
  x = jnp.ones((8, 16), jnp.float32)
  compiled = compile_shard_map(
      mesh,
      lambda a: lax.psum_scatter(a, axis, scatter_dimension=1, tiled=True), x,
      P(), P(None, axis))
  n = mesh.shape[axis]
  op = only(hlo.collective_ops(compiled, mesh))
  assert (op.opcode, op.kind, op.axis) == ("reduce-scatter", "reduce-scatter",
                                           axis)
  assert op.bytes == 8 * 16 * F32 * (n - 1) // n  # input is the whole array


@pytest.mark.parametrize("shape,names,axis", MESH_AXES)
def test_all_gather(shape, names, axis):
  mesh = make_mesh(shape, names)
  x = jnp.ones((8, 16), jnp.float32)
  compiled = compile_shard_map(
      mesh, lambda a: lax.all_gather(a, axis, axis=1, tiled=True), x,
      P(None, axis), P())
  n = mesh.shape[axis]
  assert hlo.collectives(compiled, mesh) == [
      hlo.Collective("all-gather", axis, 1, 8 * 16 * F32 * (n - 1) // n,
                     False)
  ]


def test_all_to_all():
  mesh = make_mesh(*MESH_2x4)
  x = jnp.ones((8, 16), jnp.float32)
  spec = P("data", "fsdp")
  compiled = compile_shard_map(
      mesh, lambda a: lax.all_to_all(a, "fsdp", 0, 1, tiled=True), x, spec,
      spec)
  block = block_bytes(mesh, x.shape, spec)
  assert hlo.collectives(compiled, mesh) == [
      hlo.Collective("all-to-all", "fsdp", 1, block * 3 // 4, False)
  ]


def test_ragged_all_to_all_is_an_all_to_all_of_the_rows_it_may_send():
  """Read from the HLO XLA receives (XLA:CPU cannot compile the op): the
  bytes are its first operand's, the rows it may send, not its output
  buffer's or its offsets'."""
  mesh = make_mesh(*MESH_2x4)
  shard = NamedSharding(mesh, P("fsdp"))
  rows = jax.ShapeDtypeStruct((32, 3), jnp.bfloat16, sharding=shard)  # 8 rows a device
  counts = jax.ShapeDtypeStruct((16,), jnp.int32, sharding=shard)  # 4 a device, one a peer

  def send(rows_RxD, offsets, sizes, their_offsets, received):
    output_SxD = jnp.zeros((12, 3), rows_RxD.dtype)
    return lax.ragged_all_to_all(rows_RxD, output_SxD, offsets, sizes, their_offsets, received,
                                 axis_name="fsdp")

  lowered = jax.jit(jax.shard_map(send, mesh=mesh, in_specs=(P("fsdp"),) * 5,
                                  out_specs=P("fsdp"))).lower(rows, *[counts] * 4)
  op = only(hlo.collective_ops(lowered.compiler_ir("hlo").as_hlo_text(), mesh))
  assert (op.opcode, op.kind, op.axis, op.group_size) == (
      "ragged-all-to-all", "all-to-all", "fsdp", 4)
  assert op.operand_bytes == 8 * 3 * 2 and op.bytes == 8 * 3 * 2 * 3 // 4


@pytest.mark.parametrize("shape,names,axis", MESH_AXES)
def test_ppermute_is_collective_permute(shape, names, axis):
  mesh = make_mesh(shape, names)
  n = mesh.shape[axis]
  spec = P(names)
  x = jnp.ones((16, 8), jnp.float32)
  ring = [(i, (i + 1) % n) for i in range(n)]
  compiled = compile_shard_map(mesh, lambda a: lax.ppermute(a, axis, ring), x,
                               spec, spec)
  assert hlo.collectives(compiled, mesh) == [
      hlo.Collective("collective-permute", axis, 1,
                     block_bytes(mesh, x.shape, spec), False)
  ]


def test_device_ids_are_positions_in_a_permuted_mesh():
  mesh = make_mesh(*MESH_2x4, order=[3, 1, 7, 5, 0, 2, 6, 4])
  spec = P("data", "fsdp")
  x = jnp.ones((8, 16), jnp.float32)
  compiled = compile_shard_map(mesh, lambda a: lax.psum(a, "data"), x, spec,
                               spec)
  assert "replica_groups={{0,4},{1,5},{2,6},{3,7}}" in compiled.as_text()
  assert only(hlo.collectives(compiled, mesh)).axis == "data"
  assert only(hlo.collectives(compiled.as_text(), mesh)).axis == "data"


# ----------------------------------------------------------- loops


def test_scan_multiplies_by_trip_count():
  mesh = make_mesh(*MESH_2x4)
  spec = P("data", "fsdp")
  x = jnp.ones((8, 16), jnp.float32)

  def six_psums(a):
    step = lambda c, _: (lax.psum(c, "fsdp") * 0.5, None)
    return lax.scan(step, a, None, length=6)[0]

  compiled = compile_shard_map(mesh, six_psums, x, spec, spec)
  per_run = 2 * block_bytes(mesh, x.shape, spec) * 3 // 4
  assert hlo.collectives(compiled, mesh) == [
      hlo.Collective("all-reduce", "fsdp", 6, 6 * per_run, True)
  ]


def test_a_traced_run_counts_only_the_branches_taken():
  mesh = make_mesh(*MESH_2x4)
  spec = P("data", "fsdp")
  x = jax.device_put(jnp.ones((8, 16), jnp.float32), NamedSharding(mesh, spec))

  def psum_every_third(a):
    def step(c, i):
      return lax.cond(i % 3 == 0, lambda c: lax.psum(c, "fsdp") * 0.5, lambda c: c, c), None
    return lax.scan(step, a, jnp.arange(6))[0]

  compiled = compile_shard_map(mesh, psum_every_third, x, spec, spec)
  executed = op_trace.executions(lambda: compiled(x), compiled, mesh.size)
  per_run = 2 * block_bytes(mesh, x.shape, spec) * 3 // 4
  assert hlo.collectives(compiled, mesh) == [  # static: the branch as if taken every time
      hlo.Collective("all-reduce", "fsdp", 6, 6 * per_run, True)]
  assert hlo.collectives(compiled, mesh, executed) == [
      hlo.Collective("all-reduce", "fsdp", 2, 2 * per_run, True)]


def test_while_without_trip_count_counts_once_and_warns():
  mesh = make_mesh(*MESH_2x4)
  spec = P("data", "fsdp")

  def halve_until_small(a):
    body = lambda b: lax.psum(b, "fsdp") * 0.1
    return lax.while_loop(lambda b: b.sum() > 1.0, body, a)

  compiled = compile_shard_map(mesh, halve_until_small,
                               jnp.ones((8, 16), jnp.float32), spec, spec)
  with pytest.warns(UserWarning, match="known trip count"):
    op = only(hlo.collective_ops(compiled, mesh))
  assert (op.count, op.in_loop, op.trip_count_known) == (1, True, False)


# ------------------------------------------------------------- GSPMD (jit)


def sharded(mesh: Mesh, shape: tuple[int, ...], spec: P,
            dtype=jnp.float32) -> jax.ShapeDtypeStruct:
  return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))


def test_matmul_over_sharded_contraction_all_reduces():
  mesh = make_mesh(*MESH_2x4)
  x = sharded(mesh, (8, 32), P(None, "fsdp"))
  w = sharded(mesh, (32, 16), P("fsdp", None))
  compiled = jax.jit(lambda a, b: a @ b,
                     out_shardings=NamedSharding(mesh, P())).lower(x,
                                                                   w).compile()
  out_bytes = 8 * 16 * F32  # each device reduces its partial [8, 16] product
  assert hlo.collectives(compiled, mesh) == [
      hlo.Collective("all-reduce", "fsdp", 1, 2 * out_bytes * 3 // 4, False)
  ]


def test_replicating_a_sharded_array_all_gathers():
  mesh = make_mesh(*MESH_2x4)
  x = sharded(mesh, (16, 32), P("data", "fsdp"))
  compiled = jax.jit(lambda a: a * 2,
                     out_shardings=NamedSharding(mesh, P())).lower(x).compile()
  total = 16 * 32 * F32
  by_axis = {c.axis: c for c in hlo.collectives(compiled, mesh)}
  assert {c.kind for c in by_axis.values()} == {"all-gather"}
  # XLA gathers fsdp first (output total / 2), then data (output total).
  assert by_axis["fsdp"].bytes == total // 2 * 3 // 4
  assert by_axis["data"].bytes == total * 1 // 2


def test_gspmd_reduce_scatter_is_sliced_all_reduce_on_cpu():
  mesh = make_mesh(*MESH_2x4)
  x = sharded(mesh, (16, 32), P("data", None))
  compiled = jax.jit(
      lambda a: a.sum(0),
      out_shardings=NamedSharding(mesh, P("data"))).lower(x).compile()
  op = only(hlo.collective_ops(compiled, mesh))
  assert (op.opcode, op.kind, op.axis) == ("all-reduce", "reduce-scatter",
                                           "data")
  assert op.bytes == (32 * F32) * 1 // 2  # counted as the reduce-scatter a GPU runs


def test_unsliced_all_reduce_stays_all_reduce():
  mesh = make_mesh(*MESH_2x4)
  x = sharded(mesh, (16, 32), P("data", None))
  compiled = jax.jit(lambda a: a.sum(0),
                     out_shardings=NamedSharding(mesh, P())).lower(x).compile()
  assert only(hlo.collective_ops(compiled, mesh)).kind == "all-reduce"


def test_fsdp_tensor_training_step_in_a_layer_scan():
  mesh = make_mesh(*MESH_2x2x2)
  layers = 3

  def loss(params, x):
    layer = lambda h, w: (h + jnp.tanh(h @ w[0]) @ w[1], None)
    return (lax.scan(layer, x, params)[0]**2).mean()

  def step(params, x):
    grads = jax.grad(loss)(params, x)
    return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)

  w_specs = (P(None, "fsdp", "tensor"), P(None, "tensor", "fsdp"))
  params = (sharded(mesh, (layers, 32, 64), w_specs[0], jnp.bfloat16),
            sharded(mesh, (layers, 64, 32), w_specs[1], jnp.bfloat16))
  x = sharded(mesh, (16, 32), P(("data", "fsdp")), jnp.bfloat16)
  out_shardings = tuple(NamedSharding(mesh, s) for s in w_specs)
  compiled = jax.jit(step, out_shardings=out_shardings).lower(params,
                                                              x).compile()
  found = {(c.kind, c.axis): c for c in hlo.collectives(compiled, mesh)}
  for key in [("all-gather", "fsdp"), ("reduce-scatter", "fsdp"),
              ("all-reduce", "tensor")]:
    assert found[key].in_loop and found[key].count % layers == 0, key
    assert found[key].bytes > 0


# ------------------------------------------------------- HLO text spellings

SYNTHETIC_HLO = """\
HloModule synthetic, num_partitions=8

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %sum = f32[] add(%a, %b)
}

ENTRY %main (p: bf16[4,8], q: f32[16]) -> (bf16[8,8], f32[16], f32[16], f32[16]) {
  %p = bf16[4,8]{1,0} parameter(0)
  %q = f32[16]{0} parameter(1)
  %ag-start = (bf16[4,8]{1,0}, bf16[8,8]{1,0}) all-gather-start(%p), channel_id=1, replica_groups=[4,2]<=[2,4]T(1,0), dimensions={0}, use_global_device_ids=true
  %ag-done = bf16[8,8]{1,0} all-gather-done(%ag-start)
  %ar-start = f32[16]{0} all-reduce-start(%q), channel_id=2, replica_groups=mesh['x'=2,'y'=4] {'y':(1)2}, use_global_device_ids=true, to_apply=%add
  %ar-done = f32[16]{0} all-reduce-done(%ar-start)
  %cp-start = (f32[16]{0}, f32[16]{0}, u32[], u32[]) collective-permute-start(%q), channel_id=3, source_target_pairs={{0,4},{4,0}}
  %cp-done = f32[16]{0} collective-permute-done(%cp-start)
  %ar = f32[16]{0} all-reduce(%q), channel_id=4, replica_groups=mesh['x'=2,'y'=4], device_ids=([4,2]T(1,0)) {'x'}, use_global_device_ids=true, to_apply=%add
  ROOT %out = (bf16[8,8]{1,0}, f32[16]{0}, f32[16]{0}, f32[16]{0}) tuple(%ag-done, %ar-done, %cp-done, %ar)
}
"""


def test_hlo_text_spellings_and_async_pairs():
  mesh = make_mesh(*MESH_2x4)
  ops = {op.name: op for op in hlo.collective_ops(SYNTHETIC_HLO, mesh)}
  assert set(ops) == {"ag-start", "ar-start", "cp-start", "ar"}
  # [4,2]<=[2,4]T(1,0) = {0,4},{1,5},{2,6},{3,7}; bf16[4,8] is 64 bytes.
  assert (ops["ag-start"].kind, ops["ag-start"].axis,
          ops["ag-start"].bytes) == ("all-gather", "data", 64)
  # Sub-axis y:(1)2 pairs y with y+2: {0,2},{1,3},{4,6},{5,7}.
  assert (ops["ar-start"].kind, ops["ar-start"].axis,
          ops["ar-start"].group_size) == ("all-reduce", "fsdp", 2)
  assert ops["ar-start"].bytes == 2 * 64 // 2
  assert (ops["cp-start"].axis, ops["cp-start"].bytes) == ("data", 64)
  # device_ids [0,2,4,6,1,3,5,7] as a 2x4 mesh: x pairs devices 2k, 2k+1.
  assert (ops["ar"].axis, ops["ar"].group_size) == ("fsdp", 2)


def test_element_sizes():
  assert hlo._shape_bytes("(bf16[2,3]{1,0}, pred[5], s32[], f8e4m3fn[4])") == (
      12 + 5 + 4 + 4)
  assert hlo._shape_bytes("s4[3]") == 2
  assert hlo._shape_bytes("token[]") == 0


def test_text_and_compiled_agree_and_stablehlo_is_rejected():
  mesh = make_mesh(*MESH_2x4)
  spec = P("data", "fsdp")
  lowered = jax.jit(
      jax.shard_map(lambda a: lax.psum(a, "fsdp"), mesh=mesh, in_specs=spec,
                    out_specs=spec,
                    check_vma=False)).lower(jnp.ones((8, 16), jnp.float32))
  compiled = lowered.compile()
  assert hlo.collectives(compiled.as_text(), mesh) == hlo.collectives(
      compiled, mesh)
  with pytest.raises(ValueError, match="ENTRY"):
    hlo.collectives(lowered.as_text(), mesh)


# ------------------------------------------------------------------ memory


def test_memory_bytes():
  mesh = make_mesh(*MESH_2x4)
  x = sharded(mesh, (16, 32), P("data", None))
  compiled = jax.jit(
      lambda a: a.sum(0),
      out_shardings=NamedSharding(mesh, P("data"))).lower(x).compile()
  memory = hlo.memory_bytes(compiled)
  assert set(memory) == {"arguments", "outputs", "temp", "alias", "total"}
  assert all(isinstance(v, int) and v >= 0 for v in memory.values())
  assert memory["arguments"] == 8 * 32 * F32  # this device's rows
  assert memory["outputs"] == 16 * F32  # half of f32[32]
  assert memory["total"] == (memory["arguments"] + memory["outputs"] +
                             memory["temp"] - memory["alias"])
