"""Rotary position embedding (RoPE), with Llama 3's frequency scaling.

Llama 3.1 and 3.2 stretch the context by scaling RoPE's frequencies (Hugging
Face `rope_type: llama3`): wavelengths shorter than the original context /
`high_freq_factor` stay, those longer than original context / `low_freq_factor`
are divided by `factor`, and the band between is interpolated smoothly.
"""

import dataclasses
import math

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Llama3Scaling:
  factor: float
  low_freq_factor: float
  high_freq_factor: float
  original_max_positions: int


def frequencies(head_dim: int, theta: float, scaling: Llama3Scaling | None = None) -> jax.Array:
  """The head_dim / 2 rotation frequencies (radians per position)."""
  half = head_dim // 2
  freq_H = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
  if scaling is None:
    return freq_H
  wavelength_H = 2 * math.pi / freq_H
  long_wavelength = scaling.original_max_positions / scaling.low_freq_factor
  short_wavelength = scaling.original_max_positions / scaling.high_freq_factor
  smooth_H = ((scaling.original_max_positions / wavelength_H - scaling.low_freq_factor)
              / (scaling.high_freq_factor - scaling.low_freq_factor))
  interpolated_H = (1 - smooth_H) * freq_H / scaling.factor + smooth_H * freq_H
  return jnp.where(wavelength_H < short_wavelength, freq_H,
                   jnp.where(wavelength_H > long_wavelength, freq_H / scaling.factor,
                             interpolated_H))


def rotary(x_BxLxNxH: jax.Array, positions_BxL: jax.Array, theta: float,
           scaling: Llama3Scaling | None = None) -> jax.Array:
  """Rotary position embedding (rotate-half form, as Hugging Face's Llama) at absolute positions."""
  freq_H = frequencies(x_BxLxNxH.shape[-1], theta, scaling)
  angle_BxLx1xH = (positions_BxL[..., None].astype(jnp.float32) * freq_H)[:, :, None, :]
  sin, cos = jnp.sin(angle_BxLx1xH), jnp.cos(angle_BxLx1xH)
  x1, x2 = jnp.split(x_BxLxNxH.astype(jnp.float32), 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x_BxLxNxH.dtype)
