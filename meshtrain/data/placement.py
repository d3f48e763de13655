"""A global batch across processes: the rows a process reads, and its rows as global arrays."""

import jax
import numpy as np

from meshtrain.errors import ConfigError


def process_rows(sharding, global_shape: tuple[int, ...]) -> range:
  """The rows of the global batch that this process's devices hold: the only
  ones it reads. Under a hybrid mesh they are one contiguous block."""
  spans = {(index[0].start or 0, global_shape[0] if index[0].stop is None else index[0].stop)
           for index in sharding.addressable_devices_indices_map(global_shape).values()}
  first, end = min(s for s, _ in spans), max(e for _, e in spans)
  if sum(e - s for s, e in spans) != end - first:
    raise ConfigError("config.mesh.across_hosts", "this process's devices hold rows of the batch "
                      "that are not one block; put `data` first in across_hosts")
  return range(first, end)


def to_global(local_batch: dict[str, np.ndarray], sharding,
              global_shape: tuple[int, ...] | None = None) -> dict[str, jax.Array]:
  """This process's rows -> one global array per key, laid out by `sharding`."""
  return {key: jax.make_array_from_process_local_data(sharding, value, global_shape)
          for key, value in local_batch.items()}
