"""Weight offload (`config.offload.params`): the layers' ZeRO-3/FSDP shards stay
in pinned host memory, and each layer's come to the device only while it runs.

`fetch` is what the model's layer-weights slot calls on each layer's weights
(`meshtrain.train.parallelize`): a copy of the weights that lie on the host to
device memory (whose transpose sends the gradient back to the host) and their
cast to the working dtype. Weights already on the device pass as they are.
"""

from typing import Any

import jax


def fetch(weights: Any, working_dtype) -> Any:
  """`weights` on the device in `working_dtype`, where they lie on the host."""
  def one(w):
    if jax.typeof(w).memory_space != jax.memory.Space.Host:
      return w
    return jax.device_put(w, jax.memory.Space.Device).astype(working_dtype)
  return jax.tree.map(one, weights)
