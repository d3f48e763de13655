"""float16 training: dynamic loss scaling (jmp), kept in the train state.

float16 keeps 5 exponent bits: activation gradients below 6e-8 flush to zero
and above 65504 overflow. The loss is multiplied by a scale before the backward
pass and the float32 gradients divided by it after. The scale doubles after
`period` finite steps in a row and halves when a gradient overflows; that
step's update is skipped and counted, as in Apex, Megatron and DeepSpeed
(Micikevicius et al. 2018). bfloat16 has float32's exponent range and needs none.
"""

import dataclasses

import jax
import jax.numpy as jnp
import jmp

from meshtrain.errors import ConfigError

FACTOR = 2  # the scale's step up and down


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LossScale:
  scale: jax.Array           # float32: multiplies the loss before the backward pass
  good_steps: jax.Array      # int32: finite steps since the scale last changed
  overflow_steps: jax.Array  # int32: steps skipped because a gradient overflowed


def uses_loss_scale(cfg) -> bool:
  return "float16" in (cfg.param_dtype, cfg.compute_dtype)


def validate(cfg) -> None:
  if uses_loss_scale(cfg) and (cfg.mesh.pipeline != 1 or cfg.local_sgd.inner_steps):
    raise ConfigError("config.param_dtype" if cfg.param_dtype == "float16" else "config.compute_dtype",
                      "float16 loss scaling is not wired into the pipeline or local SGD yet; "
                      "use bfloat16 there")


def initial_loss_scale(cfg) -> LossScale | None:
  """The starting state when the config trains in float16, else None."""
  if not uses_loss_scale(cfg):
    return None
  return LossScale(jnp.float32(cfg.loss_scale.initial), jnp.int32(0), jnp.int32(0))


def adjust(loss_scale: LossScale, finite: jax.Array, overflow: jax.Array,
           period: int) -> LossScale:
  """The next state: jmp's dynamic rule (halve unless `finite`), `overflow` counted."""
  dynamic = jmp.DynamicLossScale(loss_scale.scale, loss_scale.good_steps, period=period,
                                 factor=FACTOR).adjust(finite)
  return LossScale(dynamic.loss_scale, dynamic.counter,
                   loss_scale.overflow_steps + overflow.astype(jnp.int32))
