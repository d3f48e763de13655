"""GPU clusters to compile for on any machine: XLA's GPU compiler runs without a GPU.

`parse("h100:2x8")` names a cluster (a kind, hosts x devices a host);
`devices(target)` gives its devices, made from XLA's description of the GPU
(a `GpuTargetConfigProto`, shipped here for the kinds in `KINDS`, or any
`.txtpb` file). They go where real devices go (`Mesh`, `setup.build`), and
`jit(...).lower(...).compile()` over them builds the program those GPUs
would run: its memory and collective schedule are real, its kernels are not
autotuned (no device to time them on).

Needs jax's CUDA plugin and ptxas (the `dev` extra: `jax-cuda12-plugin`,
`nvidia-cuda-nvcc-cu12`, `nvidia-cudnn-cu12`). On a machine without a GPU the
plugin must not try to start one: `devices` runs the CPU backend and hides
the CUDA devices before jax starts a backend (what `jax.devices()` does), so
call it first, or after the backend started on the CPU.
"""

import dataclasses
import functools
import os
import re
from pathlib import Path

import jax
from jax.experimental import topologies

from meshtrain import quiet_cuda
from meshtrain.errors import ConfigError, reading

KINDS = {"h100": "h100.txtpb", "h200": "h200.txtpb"}  # the GPU descriptions shipped here
MAX_DEVICES = 4096  # the most devices a target may have (a compile's host memory grows with them)
_HERE = Path(__file__).parent


@dataclasses.dataclass(frozen=True)
class Target:
  """A cluster of `hosts` x `devices_per_host` GPUs described by `config_text`."""
  name: str                # the kind (`h100`) or the description file's stem
  hosts: int
  devices_per_host: int
  config_text: str         # a GpuTargetConfigProto in text format

  @property
  def num_devices(self) -> int:
    return self.hosts * self.devices_per_host

  @property
  def memory_bytes(self) -> int:
    """One device's memory, as the description gives it."""
    return int(_field(self.config_text, "device_memory_size"))

  @property
  def device_kind(self) -> str:
    return _field(self.config_text, "device_description_str").strip('"')

  def __str__(self) -> str:
    return f"{self.name}:{self.hosts}x{self.devices_per_host}"


def _field(text: str, name: str) -> str:
  match = re.search(rf"^\s*{name}:\s*(.+?)\s*$", text, re.M)
  if not match:
    raise ConfigError("--target", f"the GPU description has no {name}")
  return match.group(1)


def parse(spec: str) -> Target:
  """`KIND:HOSTSxDEVICES` (`h100:1x8`, `h200:8x8`, `path/gpu.txtpb:2x8`) as a Target."""
  kind, _, shape = spec.rpartition(":")
  match = re.fullmatch(r"(\d+)x(\d+)", shape)
  if not kind or not match:
    raise ConfigError("--target", f"{spec!r} is not KIND:HOSTSxDEVICES; e.g. --target h100:1x8 "
                      "(one host of 8) or --target h200:8x8 (KIND: "
                      f"{', '.join(KINDS)}, or a GpuTargetConfigProto .txtpb file)")
  hosts, per_host = int(match.group(1)), int(match.group(2))
  if hosts < 1 or per_host < 1 or hosts * per_host > MAX_DEVICES:
    raise ConfigError("--target", f"{hosts}x{per_host} devices; give 1 to {MAX_DEVICES} in all, "
                      "e.g. 1x8")
  if kind in KINDS:
    return Target(kind, hosts, per_host, (_HERE / KINDS[kind]).read_text())
  path = Path(kind)
  if not path.is_file():
    raise ConfigError("--target", f"{kind!r} is neither a GPU kind ({', '.join(KINDS)}) nor a "
                      "GpuTargetConfigProto file")
  with reading("--target", path):
    text = path.read_text()
  target = Target(path.stem, hosts, per_host, text)
  target.memory_bytes  # noqa: B018 (checks the description has the fields read later)
  target.device_kind  # noqa: B018
  return target


def devices(target: Target) -> list:
  """The target's devices, host by host (each carries its host's
  `process_index`), for compiling only."""
  return list(_topology(target.config_text, target.hosts, target.devices_per_host).devices)


@functools.cache
def _topology(config_text: str, hosts: int, per_host: int):
  if quiet_cuda.no_driver():  # before the plugin initialises CUDA (cuInit)
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    jax.config.update("jax_platforms", "cpu")
  if not quiet_cuda.plugin_installed():
    raise ConfigError("--target", "compiling for GPUs needs jax's CUDA plugin and ptxas: "
                      "pip install -e '.[dev]' (or jax-cuda12-plugin, nvidia-cuda-nvcc-cu12 "
                      "and nvidia-cudnn-cu12 at jax's version)")
  try:
    with quiet_cuda.stderr_filtered():
      return topologies.get_topology_desc(platform="cuda", target_config=config_text,
                                          topology=f"1x{hosts}x{per_host}")
  except Exception as error:  # noqa: BLE001 (XLA raises its own status types)
    raise ConfigError("--target", f"XLA cannot describe {hosts}x{per_host} GPUs from this "
                      f"description ({str(error).splitlines()[0]})") from None
