"""Float8 training (`config.float8`, `meshtrain.parallel.float8`): the
quantized matmul and its gradients against a quantizer written here in numpy
and ml_dtypes (float64 GEMMs of the dequantized operands), the model's
projections in float8 on a mesh against the same float8 model on one device.
What the GPU compiler makes of the GEMMs: tests/test_gpu_program.py."""

import jax
import ml_dtypes
import numpy as np
import pytest

from conftest import micro_config, tiered
from equivalence import meshtrain_run
from meshtrain.errors import ConfigError
from meshtrain.parallel import float8
from meshtrain.train.setup import build
from reference import random_batches

# Formats of (forward operands, gradient) by recipe, as docs/float8.md gives them.
FORMATS = {"tensorwise": (ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2),
           "rowwise": (ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e4m3fn),
           "blockwise": (ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e4m3fn)}
BLOCK = 128  # DeepSeek-V3's: 1 x 128 groups of activations and gradients, 128 x 128 of weights


def dequantized(x: np.ndarray, dtype, axes) -> np.ndarray:
  """x through `dtype` with a float32 scale from its absolute maximum over
  `axes` (None: the whole array), back in float64."""
  x32 = x.astype(np.float32)
  largest = np.float32(ml_dtypes.finfo(dtype).max)
  amax = np.max(np.abs(x32), axis=axes, keepdims=True)
  scale = np.where(amax > 0, amax / largest, np.float32(1)).astype(np.float32)
  q = np.clip(x32 / scale, -largest, largest).astype(dtype)
  return q.astype(np.float64) * scale.astype(np.float64)


def block_dequantized(x: np.ndarray, dtype, axes) -> np.ndarray:
  """x through `dtype` block by block: BLOCK along each of `axes` (the last
  block of a dimension BLOCK does not divide shorter), 1 along the others."""
  out = np.empty(x.shape, np.float64)
  steps = [BLOCK if i in axes else 1 for i in range(x.ndim)]
  for corner in np.ndindex(*(-(-n // step) for n, step in zip(x.shape, steps))):
    block = tuple(slice(i * step, (i + 1) * step) for i, step in zip(corner, steps))
    out[block] = dequantized(x[block], dtype, None)
  return out


def reference_block_gemms(equation: str, x, w, g) -> dict[str, np.ndarray]:
  """blockwise's three GEMMs in float64: x and g in 1 x BLOCK groups along
  their last dimension, w in BLOCK x BLOCK blocks over its last contracted
  and last kept dimensions, all e4m3."""
  inputs, out = equation.split("->")
  x_dims, w_dims = inputs.split(",")
  e4m3 = ml_dtypes.float8_e4m3fn
  w_axes = ([i for i, d in enumerate(w_dims) if d not in out][-1],
            [i for i, d in enumerate(w_dims) if d in out][-1])
  qx, qw, qg = (block_dequantized(a, e4m3, axes) for a, axes in (
      (x, (x.ndim - 1,)), (w, w_axes), (g, (g.ndim - 1,))))
  return {"forward": np.einsum(equation, qx, qw),
          "input gradient": np.einsum(f"{out},{w_dims}->{x_dims}", qg, qw),
          "weight gradient": np.einsum(f"{x_dims},{out}->{w_dims}", qx, qg)}


def reference_gemm(equation: str, a, a_dtype, b, b_dtype, rowwise: bool) -> np.ndarray:
  """One GEMM of the recipe in float64: each operand quantized per slice
  along the dimensions it keeps (rowwise: scales over the contracted ones)."""
  inputs, out = equation.split("->")
  a_dims, b_dims = inputs.split(",")
  contracted = (set(a_dims) & set(b_dims)) - set(out)

  def axes(dims):
    return tuple(i for i, d in enumerate(dims) if d in contracted) if rowwise else None
  return np.einsum(equation, dequantized(a, a_dtype, axes(a_dims)),
                   dequantized(b, b_dtype, axes(b_dims)))


# (equation, x shape, w shape): the MLP's, the fused gate/up, the attention's
# output (two contracted dimensions); sizes that no block or power of two
# divides, and beyond a block (blockwise: 3 x 3 blocks of w, the last short).
MATMULS = [("bld,df->blf", (2, 5, 12), (12, 7)),
           ("bld,cdf->cblf", (3, 4, 9), (2, 9, 6)),
           ("blnh,nhd->bld", (2, 3, 4, 5), (4, 5, 11)),
           ("bld,df->blf", (2, 3, 300), (300, 260)),
           ("blnh,nhd->bld", (1, 3, 2, 136), (2, 136, 140))]


@pytest.mark.parametrize("recipe", sorted(float8.RECIPES))
@pytest.mark.parametrize("equation, x_shape, w_shape", MATMULS, ids=[m[0] for m in MATMULS])
def test_the_float8_matmul_and_its_gradients_equal_the_recipe_written_in_numpy(
    recipe, equation, x_shape, w_shape):
  """Forward, input gradient and weight gradient each equal the float64 GEMM
  of operands quantized as the recipe says, to float32 accumulation; with an
  all-zero row of x and an all-zero output column of w (scale 1); and they
  are float8's, not the exact product's."""
  rng = np.random.default_rng(0)
  x = rng.normal(size=x_shape).astype(np.float32) * 3
  w = rng.normal(size=w_shape).astype(np.float32) / 2
  x[0, 0] = 0  # a row of x that is all zeros
  w[..., 0] = 0  # a column of w (an output feature) that is all zeros
  w[..., BLOCK:2 * BLOCK, BLOCK:2 * BLOCK] = 0  # where w spans blocks, an all-zero one
  inputs, out = equation.split("->")
  x_dims, w_dims = inputs.split(",")
  y, vjp = jax.vjp(lambda x, w: float8.einsum(equation, x, w, recipe), x, w)
  g = rng.normal(size=y.shape).astype(np.float32)
  g_x, g_w = vjp(g)
  fwd, grad = FORMATS[recipe]
  rowwise = recipe == "rowwise"
  want = reference_block_gemms(equation, x, w, g) if recipe == "blockwise" else {
      "forward": reference_gemm(equation, x, fwd, w, fwd, rowwise),
      "input gradient": reference_gemm(f"{out},{w_dims}->{x_dims}", g, grad, w, fwd, rowwise),
      "weight gradient": reference_gemm(f"{x_dims},{out}->{w_dims}", x, fwd, g, grad, rowwise)}
  exact = {"forward": np.einsum(equation, x, w), "input gradient": np.einsum(
      f"{out},{w_dims}->{x_dims}", g, w), "weight gradient": np.einsum(
          f"{x_dims},{out}->{w_dims}", x, g)}
  for name, got in (("forward", y), ("input gradient", g_x), ("weight gradient", g_w)):
    scale = np.abs(want[name]).max()
    np.testing.assert_allclose(got, want[name], rtol=1e-5, atol=1e-6 * scale, err_msg=name)
    assert np.abs(exact[name] - want[name]).max() > 1e-3 * scale, name  # it is quantized


# Float8 of a sharded run against float8 on one device: one SGD step, whose
# update is the gradient. The scales are maxima, exact in any reduction order
# (and taken over the whole batch: `jnp.max` of a sharded array), and both
# quantize the same microbatches, so the two differ only where a float32
# value, summed in another order, lands on the other side of a float8
# rounding boundary: that element moves by one float8 step, rarely. Measured:
# the update within 6e-4 of its norm, where float8 itself moves it by 0.19 of
# it (against float32). Over more steps the flips compound (3 steps: 7e-2),
# so one step is what tells a wrong scale from rounding. A flip in the
# forward moves the loss and every gradient after it: with seed 0, MLA
# without a query latent has a key-value latent element within a float32
# rounding of an e4m3 tie under rowwise and blockwise scales (a repeated
# token's, so 7 elements flip: the update 3.5% off), so those cases run it
# under tensorwise, whose one scale puts it nowhere near a tie.
# Multi-head Latent Attention (its up-projections and output in float8, its
# down-projections in the working dtype): a query latent 24 wide, a key-value
# latent 16, heads of 8 + 4 rotated dimensions, values 6 wide.
MLA = {"model.num_kv_heads": 4, "model.mla.kv_lora_rank": 16, "model.mla.q_lora_rank": 24,
       "model.mla.rope_head_dim": 4, "model.mla.v_head_dim": 6}
SGD = {"optimizer.name": "sgd", "optimizer.learning_rate": 0.5, "optimizer.warmup_steps": 0,
       "optimizer.weight_decay": 0.0, "optimizer.clip_norm": 0.0}
COMPOSITIONS = {
    "rowwise fsdp=2 x tensor=2 x data=2 Megatron-SP": {
        "float8": "rowwise", "mesh.fsdp": 2, "mesh.tensor": 2, "mesh.data": 2,
        "tensor_sequence_parallel": True},
    "tensorwise zero3 data=4 x sequence=2 ring, accumulate 2, remat full": {
        "float8": "tensorwise", "zero_stage": 3, "mesh.data": 4, "mesh.sequence": 2,
        "attention.sequence_strategy": "ring", "grad_accum_steps": 2, "remat": "full"},
    "tensorwise MLA without a query latent tensor=2 x sequence=2 ulysses x fsdp=2, remat "
    "selective": {
        "float8": "tensorwise", "mesh.tensor": 2, "mesh.sequence": 2, "mesh.fsdp": 2,
        "mesh.data": 1, "attention.sequence_strategy": "ulysses", "remat": "selective", **MLA,
        "model.mla.q_lora_rank": 0},
    "tensorwise pipeline=2 zb_h1 x data=2 x sequence=2 all_gather_kv": {
        "float8": "tensorwise", "mesh.pipeline": 2, "mesh.data": 2, "mesh.sequence": 2,
        "pipeline.schedule": "zb_h1", "pipeline.microbatches": 2},
    "rowwise pipeline=2 1f1b x tensor=2 x data=2": {
        "float8": "rowwise", "mesh.pipeline": 2, "mesh.tensor": 2, "mesh.data": 2,
        "pipeline.microbatches": 2},
    "blockwise MLA fsdp=2 x tensor=2 x data=2 Megatron-SP, accumulate 2": {
        "float8": "blockwise", "mesh.fsdp": 2, "mesh.tensor": 2, "mesh.data": 2,
        "tensor_sequence_parallel": True, "grad_accum_steps": 2, **MLA},
    "blockwise pipeline=2 zb_h1 x fsdp=2 x sequence=2 ulysses": {
        "float8": "blockwise", "mesh.pipeline": 2, "mesh.fsdp": 2, "mesh.sequence": 2,
        "mesh.data": 1, "attention.sequence_strategy": "ulysses", "pipeline.schedule": "zb_h1",
        "pipeline.microbatches": 2},
}


def updates(initial, final) -> np.ndarray:
  return np.concatenate([np.ravel(b - a) for a, b in zip(jax.tree.leaves(initial),
                                                          jax.tree.leaves(final))])


@pytest.mark.parametrize("case", tiered(COMPOSITIONS, quick=[
    "rowwise fsdp=2 x tensor=2 x data=2 Megatron-SP",
    "blockwise MLA fsdp=2 x tensor=2 x data=2 Megatron-SP, accumulate 2"]))
def test_float8_on_a_mesh_equals_float8_on_one_device(case):
  changes = {**SGD, **COMPOSITIONS[case]}
  cfg = micro_config(**changes)
  batches = random_batches(1, cfg.global_batch, cfg.seq_len, cfg.model.vocab_size)
  _, (initial, _), losses, params = meshtrain_run(cfg, batches)
  one = {k: v for k, v in changes.items() if not k.startswith(("mesh.", "pipeline."))}
  # a pipeline's microbatches quantize alone: one device accumulates them
  one["grad_accum_steps"] = changes.get("pipeline.microbatches", cfg.grad_accum_steps)
  runs = {recipe: meshtrain_run(micro_config(**{**one, "float8": recipe, "mesh.data": 1}),
                                batches, devices=jax.devices()[:1])
          for recipe in (cfg.float8, "none")}
  np.testing.assert_allclose(losses, runs[cfg.float8][2], rtol=1e-5)
  one_update = updates(initial, runs[cfg.float8][3])
  error = np.linalg.norm(updates(initial, params) - one_update) / np.linalg.norm(one_update)
  float8_effect = (np.linalg.norm(updates(initial, runs["none"][3]) - one_update)
                   / np.linalg.norm(one_update))
  assert error < 2e-3 and float8_effect > 50 * error, (error, float8_effect)


@pytest.mark.parametrize("changes, unbuilt", [
    ({"model.moe.num_experts": 4, "model.moe.experts_per_token": 2}, "experts' grouped GEMMs"),
    ({"mesh.pipeline": 2, "mesh.data": 4, "local_sgd.inner_steps": 2}, "local SGD's replicas"),
])
def test_what_float8_does_not_run_yet_is_refused_in_one_line(changes, unbuilt):
  with pytest.raises(ConfigError, match=rf"^config\.float8: tensorwise: .*{unbuilt}"):
    build(micro_config(float8="tensorwise", **changes))
