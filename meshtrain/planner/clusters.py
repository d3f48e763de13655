"""Accelerator clusters for `meshtrain plan --search`: what one device computes,
holds and sends, and how many share a host (`--cluster NAME` or `--cluster FILE.json`).

Bandwidths are per device and per direction, as a ring collective uses them:
`intra_host` over NVLink (or ICI), `inter_host` over the device's share of the
host's network (InfiniBand/RoCE NICs, or ICI across a TPU slice's hosts).
"""

import dataclasses
import json
import math
from pathlib import Path

from meshtrain.errors import ConfigError, reading

GB = 1e9


@dataclasses.dataclass(frozen=True)
class Cluster:
  name: str
  peak_flops: float        # dense bf16 FLOP/s of one device
  hbm_bytes: float         # memory of one device
  intra_host: float        # bytes/s per device and direction inside a host
  inter_host: float        # bytes/s per device and direction across hosts
  devices_per_host: int
  usable_memory: float = 0.9  # share of HBM a step may plan for (allocator, runtime, fragmentation)
  flash_attention: bool = True  # attention keeps no [length, length] scores (cuDNN's on NVIDIA GPUs)
  memory_bandwidth: float = 0.0  # HBM bytes/s of one device (0: matmuls never memory-bound)
  float8_flops: float = 0.0  # dense float8 FLOP/s of one device (0: no float8 GEMMs: bf16's)


PRESETS = {
    # Memory bandwidths from the same datasheets: H100 SXM5 3.35 TB/s, H200
    # 4.8 TB/s, A100 80GB SXM 2,039 GB/s, B200 8 TB/s, TPU v5p 2,765 GB/s.
    # NVIDIA H100 SXM5 datasheet: 989 TFLOP/s dense BF16, 80 GB HBM3, NVLink 4
    # 900 GB/s bidirectional (450 per direction); DGX H100: 8 GPUs and 8
    # ConnectX-7 400 Gb/s NICs (50 GB/s per GPU). Dense FP8: 1,979 TFLOP/s
    # (the same datasheet, for the H200 and the H800 too).
    "h100": Cluster("h100", 989e12, 80 * GB, 450 * GB, 50 * GB, 8, memory_bandwidth=3350 * GB,
                    float8_flops=1979e12),
    # NVIDIA H200 SXM datasheet: same compute and NVLink as the H100, 141 GB
    # HBM3e; HGX H200 with one 400 Gb/s NIC per GPU.
    "h200": Cluster("h200", 989e12, 141 * GB, 450 * GB, 50 * GB, 8, memory_bandwidth=4800 * GB,
                    float8_flops=1979e12),
    # NVIDIA A100 datasheet: 312 TFLOP/s dense BF16, 80 GB HBM2e, NVLink 3
    # 600 GB/s bidirectional; DGX A100 (Selene, Megatron-LM's runs): 8 GPUs
    # and 8 HDR 200 Gb/s NICs (25 GB/s per GPU).
    "a100_80gb": Cluster("a100_80gb", 312e12, 80 * GB, 300 * GB, 25 * GB, 8,
                         memory_bandwidth=2039 * GB),
    # NVIDIA H800 SXM5 (the H100 for export to China: the same compute and
    # HBM3, NVLink cut to 400 GB/s bidirectional); DeepSeek-V3's nodes (Liu et
    # al. 2024, Section 3.2): 8 GPUs and 8 InfiniBand 400 Gb/s NICs.
    "h800": Cluster("h800", 989e12, 80 * GB, 200 * GB, 50 * GB, 8, memory_bandwidth=3350 * GB,
                    float8_flops=1979e12),
    # NVIDIA A100 datasheet, 40 GB SXM: 312 TFLOP/s, 1,555 GB/s HBM2; DGX A100
    # 40GB with 8 HDR 200 Gb/s NICs.
    "a100_40gb": Cluster("a100_40gb", 312e12, 40 * GB, 300 * GB, 25 * GB, 8,
                         memory_bandwidth=1555 * GB),
    # NVIDIA DGX B200 datasheet: 72 PFLOP/s FP8 dense training over 8 GPUs, so
    # 4.5 FP8 and 2.25 PFLOP/s dense BF16 per GPU; 1,440 GB HBM3e (180 GB per
    # GPU); NVLink 5 1.8 TB/s bidirectional; 8 ConnectX-7 400 Gb/s NICs.
    "b200": Cluster("b200", 2.25e15, 180 * GB, 900 * GB, 50 * GB, 8, memory_bandwidth=8000 * GB,
                    float8_flops=4.5e15),
    # Google Cloud TPU v5p documentation: 459 TFLOP/s BF16, 95 GB HBM2e, ICI
    # 4,800 Gbps per chip over 6 links of a 3D torus (100 GB/s per link and
    # direction; a ring along one torus axis uses 2 links), 4 chips per host.
    # Inside a slice the hosts are joined by the same ICI.
    "tpu_v5p": Cluster("tpu_v5p", 459e12, 95 * GB, 200 * GB, 200 * GB, 4, flash_attention=False,
                       memory_bandwidth=2765 * GB),
}


def load(name_or_path: str) -> Cluster:
  """A preset by name, or a JSON file with the fields of `Cluster`."""
  if name_or_path in PRESETS:
    return PRESETS[name_or_path]
  path = Path(name_or_path)
  if not path.suffix == ".json" or not path.is_file():
    raise ConfigError("--cluster", f"{name_or_path!r} is neither a preset "
                      f"({', '.join(PRESETS)}) nor a JSON file")
  names = ", ".join(f.name for f in dataclasses.fields(Cluster))
  try:
    with reading("--cluster", path):
      fields = json.loads(path.read_text())
    cluster = Cluster(**{"name": path.stem, **fields})
  except (json.JSONDecodeError, UnicodeDecodeError, RecursionError, TypeError) as error:
    raise ConfigError("--cluster", f"{path}: {error}; give an object with {names}") from None
  problem = next(filter(None, (_field_problem(f.name, getattr(cluster, f.name))
                               for f in dataclasses.fields(Cluster))), None)
  if problem:
    raise ConfigError("--cluster", f"{path}: {problem}")
  return cluster


def _field_problem(name: str, value) -> str | None:
  """What is wrong with one field of a cluster file, or None."""
  if name == "name":
    return None if isinstance(value, str) and value else f"name is {value!r}; give a string"
  if name == "flash_attention":
    return None if isinstance(value, bool) else f"flash_attention is {value!r}; give true or false"
  if name == "devices_per_host":
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
      return None
    return f"devices_per_host is {value!r}; give a whole number, 1 or more"
  if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
    return f"{name} is {value!r}; give a finite number"
  if name == "usable_memory" and not 0 < value <= 1:
    return f"usable_memory is {value!r}; give a share of the memory in (0, 1]"
  optional = {"memory_bandwidth": "never memory-bound", "float8_flops": "no float8 GEMMs"}
  if name in optional and value < 0:
    return f"{name} is {value!r}; give 0 ({optional[name]}) or more"
  if name not in optional and value <= 0:
    return f"{name} is {value!r}; give a value above 0"
  return None
