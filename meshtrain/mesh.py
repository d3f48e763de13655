"""One device mesh with five named axes, sized from `config.mesh`.

Axis order follows link speed: `data` outermost (slowest links, across hosts),
`tensor` innermost (fastest links, inside a host). With several processes
(hosts), `config.mesh.across_hosts` names the axes whose devices span hosts; the
other axes stay inside each host.
"""

import math
from collections.abc import Mapping, Sequence

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh

from meshtrain.errors import ConfigError

AXES = ("data", "pipeline", "fsdp", "sequence", "tensor")
FILLING_AXES = ("data", "fsdp")  # the axes -1 may size


def axis_sizes(mesh_cfg: Mapping[str, int], num_devices: int) -> dict[str, int]:
  """Resolves the sizes in `config.mesh` against the device count: a missing
  axis is 1, and one batch axis (`data` or `fsdp`) may be -1, filling the
  devices the others leave. The other axes shape the model's layout (the
  pipeline's stages, the tensor and sequence splits, which a checkpoint's
  saved layout and the head counts depend on), so they take their sizes."""
  sizes = {axis: int(mesh_cfg.get(axis, 1)) for axis in AXES}
  fill = [axis for axis, size in sizes.items() if size == -1]
  bad = [axis for axis, size in sizes.items() if size == 0 or size < -1]
  if bad:
    raise ConfigError(f"config.mesh.{bad[0]}", f"must be a positive size or -1, got {sizes[bad[0]]}")
  if len(fill) > 1:
    raise ConfigError(
        f"config.mesh.{fill[1]}", f"only one axis may be -1, got {', '.join(fill)}")
  if fill and fill[0] not in FILLING_AXES:
    raise ConfigError(f"config.mesh.{fill[0]}", "is -1, but only a batch axis (data or fsdp) "
                      f"fills the remaining devices; give {fill[0]} its size (e.g. 2), and "
                      "data or fsdp -1 to fill the rest")
  fixed = math.prod(size for size in sizes.values() if size != -1)
  if fixed > num_devices:
    _too_few_devices(sizes, fixed, num_devices)
  if fill:
    if num_devices % fixed:
      raise ConfigError(
          f"config.mesh.{fill[0]}",
          f"-1 cannot fill {num_devices} devices: the other axes multiply to {fixed}, "
          f"which does not divide {num_devices}")
    sizes[fill[0]] = num_devices // fixed
  elif fixed != num_devices:
    shape = " x ".join(f"{a}={s}" for a, s in sizes.items() if s > 1) or "all 1"
    raise ConfigError(
        "config.mesh",
        f"{shape} makes {fixed} devices but {num_devices} are available; "
        "set the sizes to multiply to the device count or set one axis to -1")
  return sizes


# What each axis does, for the message of a mesh larger than the devices.
_AXIS_ROLES = {"pipeline": "the pipeline", "tensor": "tensor parallelism",
               "sequence": "context parallelism", "fsdp": "FSDP", "data": "data parallelism"}


def _too_few_devices(sizes: Mapping[str, int], fixed: int, num_devices: int) -> None:
  """The axes given sizes need more devices than there are: names the largest
  (the pipeline first among equals) and the fix, simulated CPU devices."""
  axis = max((a for a in _AXIS_ROLES if sizes[a] > 1), key=lambda a: sizes[a])
  shape = " x ".join(f"{a}={s}" for a, s in sizes.items() if s > 1)
  simulated = math.lcm(fixed, 8) if fixed <= 8 else fixed
  raise ConfigError(
      f"config.mesh.{axis}", f"{_AXIS_ROLES[axis]} needs {fixed} devices ({shape}), "
      f"{num_devices} found: add --config.simulate_devices={simulated} to run on simulated CPU "
      f"devices, or make config.mesh.{axis} smaller")


def host_split(sizes: Mapping[str, int], across_hosts: Sequence[str],
               num_processes: int) -> dict[str, int]:
  """How many processes each axis spans: the processes go to `across_hosts`, outer first."""
  unknown = [axis for axis in across_hosts if axis not in AXES]
  if unknown:
    raise ConfigError("config.mesh.across_hosts",
                      f"{unknown[0]!r} is not a mesh axis; use some of {', '.join(AXES)}")
  split, left = dict.fromkeys(AXES, 1), num_processes
  for axis in across_hosts:
    split[axis] = math.gcd(sizes[axis], left)
    left //= split[axis]
  if left != 1:
    spans = " x ".join(f"{axis}={sizes[axis]}" for axis in across_hosts) or "no axis"
    raise ConfigError(
        "config.mesh.across_hosts",
        f"{num_processes} processes cannot split over {spans}; name more axes (outer first, "
        f"e.g. data,pipeline) or size them to a multiple of {num_processes}")
  return split


def make_mesh(mesh_cfg: Mapping[str, int],
              devices: Sequence[jax.Device] | None = None) -> Mesh:
  """Builds the 5-axis mesh; `mesh_utils` places `tensor` on the closest devices
  and, with several processes, each process's devices in one block."""
  devices = list(jax.devices() if devices is None else devices)
  sizes = axis_sizes(mesh_cfg, len(devices))
  shape = tuple(sizes[axis] for axis in AXES)
  num_processes = len({d.process_index for d in devices})
  if num_processes > 1:
    across = [a.strip() for a in mesh_cfg.get("across_hosts", "data").split(",") if a.strip()]
    split = host_split(sizes, across, num_processes)
    hosts = tuple(split[axis] for axis in AXES)
    device_array = mesh_utils.create_hybrid_device_mesh(
        tuple(n // h for n, h in zip(shape, hosts)), hosts, devices, process_is_granule=True)
    return Mesh(device_array, AXES, axis_types=(AxisType.Auto,) * len(AXES))
  try:
    device_array = mesh_utils.create_device_mesh(shape, devices)
  except (ValueError, NotImplementedError):  # no topology information: plain order
    device_array = np.asarray(devices).reshape(shape)
  return Mesh(device_array, AXES, axis_types=(AxisType.Auto,) * len(AXES))
