"""Activation memory under tensor parallelism, with and without Megatron
sequence parallelism and selective recomputation, on the small config.

  python bench/tensor_memory.py

Compiles (does not run) the train step on 8 simulated CPU devices
(tensor=4 x data=2) and reads the per-device temp bytes; next to them what
`meshtrain plan` expects the temp to hold (gradients, the residuals the model
saves, one layer's backward). Both are also given as ratios to plain TP.
Writes docs/tensor.md's table.
"""

import os
import sys
from pathlib import Path

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"

from meshtrain.analysis import hlo  # noqa: E402
from meshtrain.config import load  # noqa: E402
from meshtrain.planner.plan import analytic, compile_step  # noqa: E402
from meshtrain.train.setup import build  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
from report import write_section  # noqa: E402

SETTINGS = {
    "TP": dict(),
    "TP + SP": dict(tensor_sequence_parallel=True),
    "TP + selective recompute": dict(remat="selective"),
    "TP + SP + selective recompute": dict(tensor_sequence_parallel=True, remat="selective"),
}


def main():
  rows = []
  for name, changes in SETTINGS.items():
    print(f"compiling {name}", flush=True)
    cfg = load(REPO / "configs" / "small.py")
    cfg.mesh.update(data=2, tensor=4)
    cfg.update(changes)
    setup = build(cfg)
    temp = hlo.memory_bytes(compile_step(setup))["temp"]
    planned = analytic(cfg, setup.spec, setup.rules, setup.mesh)["memory_bytes"]
    rows.append({"setting": name, "temp_mib": temp / 2**20,
                 "planned_mib": sum(planned[k] for k in ("grads", "activations", "backward")) / 2**20})
  base = rows[0]
  table = ["| setting | measured temp MiB | / TP | planned (grads + activations + backward) MiB | / TP |",
           "|---|---|---|---|---|"]
  for row in rows:
    table.append(f"| {row['setting']} | {row['temp_mib']:.1f} | {row['temp_mib'] / base['temp_mib']:.2f} | "
                 f"{row['planned_mib']:.1f} | {row['planned_mib'] / base['planned_mib']:.2f} |")
  write_section("tensor_memory", rows, "\n".join(table), command="python bench/tensor_memory.py",
                doc=REPO / "docs" / "tensor.md")
  print("\n".join(table))


if __name__ == "__main__":
  main()
