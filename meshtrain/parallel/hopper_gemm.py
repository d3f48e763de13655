"""A grouped GEMM for NVIDIA Hopper GPUs (sm_90: H100, H200) from jax's own
Mosaic GPU kernels (`jax.experimental.pallas.ops.gpu`): `ragged_dot_mgpu` for
the product and the rows' gradient, `transposed_ragged_dot_mgpu` for the
matrices' gradient. Each group's rows meet only their own matrix, so the work is
the rows' FLOPs plus at most a tile of padding a group, and no matrix is
copied: what `tiled` and XLA's `ragged_dot` (docs/moe.md) cannot give.

Contract: `ragged_matmul(x_NxK, w_GxKxF, groups_G) -> y_NxF` in x's dtype
(bfloat16 or float16; float32 accumulation): the first groups_G[0] rows times
w[0], the next groups_G[1] times w[1], and so on; rows past the groups come out
zero. Its gradient is the exact one of that product: the rows' by the same
kernel against the transposed matrices (rows past the groups zero), the
matrices' by the transposed kernel over each group's rows alone.

The kernels need K and F to be multiples of `ALIGN` (64); the
tile shapes are the fastest of bench/moe_gemm.py's sweep on an H200.
"""

import jax
import jax.numpy as jnp

BLOCK_M = 128  # rows of x (or of the matrices' gradient) per tile
BLOCK_N = 128  # output columns per tile
BLOCK_K = 64  # contraction per pipelined step
STAGES = 4  # pipelined steps in flight (max_concurrent_steps)
ALIGN = 64  # K and F must be multiples of this


def unsupported(device: jax.Device, compute_dtype: str, widths: dict[str, int]) -> str | None:
  """Why the kernels cannot run on `device` for matmuls in `compute_dtype`
  over `widths` (name -> K or F), or None where they can."""
  if device.platform != "gpu" or getattr(device, "compute_capability", "") != "9.0":
    return (f"it runs jax's Mosaic GPU kernels for Hopper (compute capability 9.0); "
            f"this device is {device.device_kind} ({device.platform})")
  if compute_dtype not in ("bfloat16", "float16"):
    return f"it multiplies in bfloat16 or float16, not config.compute_dtype={compute_dtype}"
  for name, width in widths.items():
    if width % ALIGN:
      return f"it tiles widths in multiples of {ALIGN}, and {name} is {width}"
  return None


def _snake(columns: int, block: int) -> int:
  """The widest band of output tiles (grid_block_n) that divides the columns' tiles."""
  return next(b for b in (8, 4, 2, 1) if (columns // block) % b == 0)


def _block(size: int, preferred: int) -> int:
  """The preferred tile side where it divides `size`, else `ALIGN`."""
  return preferred if size % preferred == 0 else ALIGN


def _product(lhs_NxK, rhs, groups_G, transpose_rhs: bool):
  """Rows of lhs by group times rhs[g] (GxKxF), or rhs[g]^T (GxFxK) if `transpose_rhs`."""
  from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu

  columns = rhs.shape[1] if transpose_rhs else rhs.shape[2]
  block_n = _block(columns, BLOCK_N)
  return ragged_dot_mgpu.ragged_dot(
      lhs_NxK, rhs, group_sizes=groups_G, block_m=BLOCK_M, block_n=block_n, block_k=BLOCK_K,
      max_concurrent_steps=STAGES, grid_block_n=_snake(columns, block_n),
      transpose_rhs=transpose_rhs)


def _group_gram(x_NxK, dy_NxF, groups_G):
  """Per group g: its rows of x, transposed, times its rows of dy (GxKxF)."""
  from jax.experimental.pallas.ops.gpu import transposed_ragged_dot_mgpu

  block_m, block_n = _block(x_NxK.shape[1], BLOCK_M), _block(dy_NxF.shape[1], BLOCK_N)
  return transposed_ragged_dot_mgpu.transposed_ragged_dot(
      x_NxK, dy_NxF, group_sizes=groups_G, block_m=block_m, block_n=block_n, block_k=BLOCK_K,
      max_concurrent_steps=STAGES, grid_block_n=_snake(dy_NxF.shape[1], block_n))


def _in_groups(y_NxF, groups_G):
  """y with the rows past the groups set to zero (the kernels leave them unwritten)."""
  rows_N = jnp.arange(y_NxF.shape[0])
  return jnp.where((rows_N < jnp.sum(groups_G))[:, None], y_NxF, jnp.zeros((), y_NxF.dtype))


@jax.custom_vjp
def ragged_matmul(x_NxK: jax.Array, w_GxKxF: jax.Array, groups_G: jax.Array) -> jax.Array:
  """See the module's contract."""
  return _in_groups(_product(x_NxK, w_GxKxF.astype(x_NxK.dtype), groups_G, False), groups_G)


def _ragged_matmul_fwd(x_NxK, w_GxKxF, groups_G):
  return ragged_matmul(x_NxK, w_GxKxF, groups_G), (x_NxK, w_GxKxF, groups_G)


def _ragged_matmul_bwd(residuals, dy_NxF):
  x_NxK, w_GxKxF, groups_G = residuals
  dy_NxF = dy_NxF.astype(x_NxK.dtype)
  dx_NxK = _in_groups(_product(dy_NxF, w_GxKxF.astype(x_NxK.dtype), groups_G, True), groups_G)
  dw_GxKxF = _group_gram(x_NxK, dy_NxF, groups_G)
  return dx_NxK, dw_GxKxF.astype(w_GxKxF.dtype), None


ragged_matmul.defvjp(_ragged_matmul_fwd, _ragged_matmul_bwd)
