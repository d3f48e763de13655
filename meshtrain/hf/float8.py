"""Fine-grained float8 checkpoints (`quantization_config.quant_method` "fp8",
transformers' `FineGrainedFP8Config`): DeepSeek-V3's and the Qwen3 "-FP8"
models as published.

Each quantized matrix `W` [rows, cols] is stored as float8 values `Q` (e4m3 or
e5m2) and a float32 grid `W_scale_inv` [ceil(rows / b0), ceil(cols / b1)], one
scale per block of `weight_block_size` [b0, b1] (the last blocks of a row or
column may be partial, as DeepSeek-V3's 576-row `kv_a_proj_with_mqa` has):
`W = Q * W_scale_inv[i // b0, j // b1]`, as DeepSeek's `weight_dequant` and
transformers' `Fp8Dequantize` compute it. Without a block size the scale is
one number per matrix. A leading dimension (experts fused in one tensor)
indexes the grid as it does the values. Scales come as floats or as UE8M0
exponents (`2 ** (e - 127)`, the "ue8m0" `scale_fmt`). meshtrain imports the
values in float32; the run's own `param_dtype` applies after.
"""

import math

import ml_dtypes
import numpy as np

SCALE_SUFFIX = "_scale_inv"  # q_proj.weight -> q_proj.weight_scale_inv
# safetensors dtypes its numpy reader lacks, read as raw bytes
RAW_DTYPES = {"F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,
              "F8_E8M0": ml_dtypes.float8_e8m0fnu}
QUANTIZED = ("F8_E4M3", "F8_E5M2")  # the values of a quantized matrix
UE8M0_BIAS = 127  # a byte `e` of a UE8M0 scale stands for 2 ** (e - 127)
E4M3_MAX = 448.0  # e4m3's largest finite value: each block's largest magnitude maps to it
EXPORT_BLOCK = (128, 128)  # DeepSeek-V3's blocks
EXPORT_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                 "weight_block_size": list(EXPORT_BLOCK)}
# HF tensors kept in bfloat16 by a float8 export, as DeepSeek-V3's checkpoint
# keeps them: the embedding, the output head and the routers (and every
# vector); of a multi-token prediction module, its projection `eh_proj` and
# its copies of the embedding and head (its block's projections are float8)
_NOT_QUANTIZED = ("embed_tokens.", "lm_head.", ".gate.weight", "shared_expert_gate.",
                  ".eh_proj.", ".shared_head.head.")


def unsupported(quantization: object) -> list[str]:
  """What of a config.json's `quantization_config` meshtrain does not read, as
  `key=value` strings (empty when its float8 blocks import)."""
  if not isinstance(quantization, dict) or quantization.get("quant_method") != "fp8":
    method = quantization.get("quant_method", "?") if isinstance(quantization, dict) else "?"
    return [f"quantization_config (quant_method={method!r}; meshtrain reads float32, bfloat16 "
            "and float16 weights and fine-grained float8 ('fp8'): convert the others first)"]
  bad = []
  block = quantization.get("weight_block_size")
  if block is not None and not (isinstance(block, list) and len(block) == 2 and all(
      isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
    bad.append(f"quantization_config.weight_block_size={block!r} (two positive integers, or "
               "null for one scale per matrix)")
  if quantization.get("expert_dtype", "fp8") != "fp8":
    bad.append(f"quantization_config.expert_dtype={quantization['expert_dtype']!r} (packed "
               "float4 experts)")
  if quantization.get("scale_fmt", "float") not in ("float", "ue8m0"):
    bad.append(f"quantization_config.scale_fmt={quantization['scale_fmt']!r}")
  return bad


def block_size(hf: dict) -> tuple[int, int] | None:
  """The [rows, cols] of one scale's block in the checkpoint `hf` describes;
  None where each matrix has one scale (or none is quantized)."""
  quantization = hf.get("quantization_config") or {}
  block = quantization.get("weight_block_size")
  return tuple(block) if block else None


def scale_values(scales: np.ndarray) -> np.ndarray:
  """Stored scales as float32 multipliers (UE8M0 bytes become powers of two)."""
  if scales.dtype == np.uint8:
    return np.exp2(scales.astype(np.float32) - UE8M0_BIAS)
  return scales.astype(np.float32)


def grid_shape(shape: tuple[int, ...], block: tuple[int, int] | None) -> tuple[int, ...] | None:
  """The scale grid a quantized tensor of `shape` has; None: one scale (a
  vector's, or every tensor's without a block size)."""
  if block is None or len(shape) < 2:
    return None
  return (*shape[:-2], math.ceil(shape[-2] / block[0]), math.ceil(shape[-1] / block[1]))


def dequantize(values: np.ndarray, scales: np.ndarray, block: tuple[int, int] | None,
               shape: tuple[int, ...], index: tuple[slice, ...]) -> np.ndarray:
  """`W[index]` in float32, from `values` (= Q[index], `index` contiguous) and
  the whole float32 scale grid of the tensor of `shape`. Scaled in place, a
  column of blocks at a time: the host holds the float32 block and the float8
  one, no scale per value."""
  out = values.astype(np.float32)
  if grid_shape(shape, block) is None:
    out *= scales.reshape(())
    return out
  index = (*index, *[slice(None)] * (len(shape) - len(index)))
  rows = np.arange(*index[-2].indices(shape[-2]))
  start, stop, _ = index[-1].indices(shape[-1])
  scales_RxG = scales[index[:-2]][..., rows // block[0], :]  # each row's scale per column block
  for column_block in range(start // block[1], math.ceil(stop / block[1])):
    low, high = max(column_block * block[1], start), min((column_block + 1) * block[1], stop)
    out[..., low - start:high - start] *= scales_RxG[..., column_block, None]
  return out


def quantized_on_export(name: str, ndim: int) -> bool:
  """Whether a float8 export writes the HF tensor `name` (of `ndim`
  dimensions) as float8 blocks: every projection matrix."""
  return ndim == 2 and not any(part in name for part in _NOT_QUANTIZED)


def quantize(matrix_RxC: np.ndarray,
             block: tuple[int, int] = EXPORT_BLOCK) -> tuple[np.ndarray, np.ndarray]:
  """(e4m3 values, float32 scales [ceil(R / b0), ceil(C / b1)]) of a matrix,
  each block's largest magnitude mapped to 448 (an all-zero block: scale 1),
  so that `dequantize` gives it back to e4m3's precision."""
  rows, cols = matrix_RxC.shape
  grid = (math.ceil(rows / block[0]), math.ceil(cols / block[1]))
  padded = np.zeros((grid[0] * block[0], grid[1] * block[1]), np.float32)
  padded[:rows, :cols] = matrix_RxC
  blocks = padded.reshape(grid[0], block[0], grid[1], block[1])
  largest = np.abs(blocks).max(axis=(1, 3))
  scales = np.where(largest > 0, largest / np.float32(E4M3_MAX), 1).astype(np.float32)
  values = (blocks / scales[:, None, :, None]).reshape(padded.shape)[:rows, :cols]
  return values.astype(ml_dtypes.float8_e4m3fn), scales
