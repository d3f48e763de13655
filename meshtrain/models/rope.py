"""Rotary position embedding (RoPE), with the two context scalings of the
Hugging Face families (their `rope_type`), each as transformers computes it:

- llama3 (Llama 3.1, 3.2): wavelengths shorter than the original context /
  `high_freq_factor` stay, those longer than original context /
  `low_freq_factor` are divided by `factor`, and the band between is
  interpolated smoothly;
- yarn (Qwen2.5 and Qwen3 long context, DeepSeek-V3): frequencies that turn
  more than `beta_fast` times in the original context stay, those that turn
  fewer than `beta_slow` times are divided by `factor`, a linear ramp over the
  dimensions between; cos and sin are multiplied by an attention factor
  (0.1 ln(factor) + 1, or DeepSeek's ratio of two such terms).
"""

import dataclasses
import math

import jax
import jax.numpy as jnp

SCALINGS = ("llama3", "yarn")  # `model.rope_scaling_type`, when `model.rope_scaling_factor` != 1


@dataclasses.dataclass(frozen=True)
class Llama3Scaling:
  factor: float
  low_freq_factor: float
  high_freq_factor: float
  original_max_positions: int


@dataclasses.dataclass(frozen=True)
class YarnScaling:
  factor: float
  original_max_positions: int
  beta_fast: float = 32.0
  beta_slow: float = 1.0
  attention_factor: float = 0.0  # 0: from factor, mscale and mscale_all_dim
  mscale: float = 0.0
  mscale_all_dim: float = 0.0
  truncate: bool = True

  @property
  def cos_sin_factor(self) -> float:
    """What cos and sin are multiplied by (transformers' `attention_factor`)."""
    if self.attention_factor:
      return self.attention_factor
    if self.mscale and self.mscale_all_dim:
      return yarn_mscale(self.factor, self.mscale) / yarn_mscale(self.factor, self.mscale_all_dim)
    return yarn_mscale(self.factor)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
  return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def frequencies(head_dim: int, theta: float,
                scaling: Llama3Scaling | YarnScaling | None = None) -> jax.Array:
  """The head_dim / 2 rotation frequencies (radians per position)."""
  half = head_dim // 2
  freq_H = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
  if scaling is None:
    return freq_H
  if isinstance(scaling, YarnScaling):
    return _yarn(freq_H, head_dim, theta, scaling)
  wavelength_H = 2 * math.pi / freq_H
  long_wavelength = scaling.original_max_positions / scaling.low_freq_factor
  short_wavelength = scaling.original_max_positions / scaling.high_freq_factor
  smooth_H = ((scaling.original_max_positions / wavelength_H - scaling.low_freq_factor)
              / (scaling.high_freq_factor - scaling.low_freq_factor))
  interpolated_H = (1 - smooth_H) * freq_H / scaling.factor + smooth_H * freq_H
  return jnp.where(wavelength_H < short_wavelength, freq_H,
                   jnp.where(wavelength_H > long_wavelength, freq_H / scaling.factor,
                             interpolated_H))


def _yarn(freq_H: jax.Array, head_dim: int, theta: float, scaling: YarnScaling) -> jax.Array:
  def dimension(turns: float) -> float:  # where a frequency turns `turns` times in the context
    return (head_dim * math.log(scaling.original_max_positions / (turns * 2 * math.pi))
            / (2 * math.log(theta)))
  low, high = dimension(scaling.beta_fast), dimension(scaling.beta_slow)
  if scaling.truncate:
    low, high = math.floor(low), math.ceil(high)
  low, high = max(low, 0), min(high, head_dim - 1)
  ramp_H = jnp.clip((jnp.arange(len(freq_H), dtype=jnp.float32) - low)
                    / (high - low if high != low else 0.001), 0, 1)
  return freq_H / scaling.factor * ramp_H + freq_H * (1 - ramp_H)


def rotary(x_BxLxNxH: jax.Array, positions_BxL: jax.Array, theta: float,
           scaling: Llama3Scaling | YarnScaling | None = None) -> jax.Array:
  """Rotary position embedding (rotate-half form, as Hugging Face's Llama) at absolute positions."""
  freq_H = frequencies(x_BxLxNxH.shape[-1], theta, scaling)
  angle_BxLx1xH = (positions_BxL[..., None].astype(jnp.float32) * freq_H)[:, :, None, :]
  sin, cos = jnp.sin(angle_BxLx1xH), jnp.cos(angle_BxLx1xH)
  if isinstance(scaling, YarnScaling):
    sin, cos = sin * scaling.cos_sin_factor, cos * scaling.cos_sin_factor
  x1, x2 = jnp.split(x_BxLxNxH.astype(jnp.float32), 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x_BxLxNxH.dtype)
