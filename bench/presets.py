"""The README's table of presets: for each model preset in configs/, its
parameters, active parameters, and the memory a device that `meshtrain plan`
gives on a named mesh (analytic; no device needed), with the command.

  python bench/presets.py > /tmp/presets.md   (then paste between the README's markers)
"""

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from meshtrain import config  # noqa: E402
from meshtrain.planner.plan import plan  # noqa: E402

# preset, devices, --config overrides (a mesh that holds it at its own batch)
ROWS = [
    ("tiny", 1, {}),
    ("small", 1, {}),
    ("llama_125m", 8, {"mesh.data": 8}),
    ("qwen3_0_6b", 32, {"mesh.data": 1, "mesh.fsdp": 32}),
    ("llama_1b", 1, {"global_batch": 8}),
    ("llama_3b", 1, {"global_batch": 4, "remat": "full"}),
    ("llama_8b", 128, {"mesh.data": 2, "mesh.fsdp": 64}),
    ("mistral_7b", 64, {"mesh.data": 1, "mesh.fsdp": 64}),
    ("qwen2_5_7b", 64, {"mesh.data": 1, "mesh.fsdp": 64}),
    ("llama_70b", 512, {"mesh.data": 8, "mesh.fsdp": 64}),
    ("qwen1_5_moe_a2_7b", 16, {"mesh.data": 4, "mesh.fsdp": 4, "zero_stage": 3, "global_batch": 16}),
    ("deepseek_v2_lite", 64, {"mesh.data": 1, "mesh.fsdp": 64, "global_batch": 64}),
    ("qwen3_30b_a3b", 64, {"mesh.data": 1, "mesh.fsdp": 64, "global_batch": 64}),
    ("mixtral_8x7b", 64, {"mesh.data": 8, "mesh.fsdp": 8, "zero_stage": 3, "global_batch": 64}),
]


def _count(n: int) -> str:
  return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def row(name: str, devices: int, overrides: dict) -> str:
  cfg = config.load(REPO / "configs" / f"{name}.py")
  for key, value in overrides.items():
    section, _, leaf = key.rpartition(".")
    (cfg[section] if section else cfg)[leaf] = value
  report = plan(cfg, devices, False)
  mesh = " x ".join(f"{a}={s}" for a, s in report["mesh"].items() if s > 1) or "one device"
  flags = " ".join(f"--config.{k}={v}" for k, v in overrides.items())
  total = report["analytic"]["memory_bytes"]["total"] / 2**30
  return (f"| `{name}` | {_count(report['parameters'])} | "
          f"{_count(report['active_parameters'])} | {cfg.global_batch} x {cfg.seq_len}, "
          f"remat {cfg.remat} | {devices}: {mesh} | {total:.1f} | "
          f"`meshtrain plan --config configs/{name}.py --devices {devices}"
          f"{' ' + flags if flags else ''}` |")


if __name__ == "__main__":
  print("| preset | parameters | active | batch x length | devices: mesh | GiB a device | plan it |")
  print("|---|---|---|---|---|---|---|")
  for name, devices, overrides in ROWS:
    print(row(name, devices, overrides), flush=True)
