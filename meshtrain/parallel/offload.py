"""Weight offload (`config.offload.params`): the layers' ZeRO-3/FSDP shards stay
in pinned host memory, and each layer's come to the device only while it runs.

The train step leaves the stacked layer weights on the host and traces the
model inside `streaming(dtype)`; the model's layer loop calls `fetch` on each
layer's weights: a copy to device memory (whose transpose sends the gradient
back to the host) and the cast to the working dtype. Under remat the
backward fetches a layer again. Outside `streaming`, and for weights already
on the device, `fetch` returns its argument.
"""

import contextlib
import contextvars
from typing import Any

import jax
import jax.numpy as jnp

_WORKING_DTYPE: contextvars.ContextVar = contextvars.ContextVar("offload_working_dtype",
                                                                default=None)


@contextlib.contextmanager
def streaming(working_dtype):
  """Traces the model with its host-resident weights fetched layer by layer."""
  token = _WORKING_DTYPE.set(jnp.dtype(working_dtype))
  try:
    yield
  finally:
    _WORKING_DTYPE.reset(token)


def fetch(weights: Any) -> Any:
  """`weights` on the device in the working dtype, where they lie on the host."""
  dtype = _WORKING_DTYPE.get()
  if dtype is None:
    return weights

  def one(w):
    if jax.typeof(w).memory_space != jax.memory.Space.Host:
      return w
    return jax.device_put(w, jax.memory.Space.Device).astype(dtype)
  return jax.tree.map(one, weights)
