"""Per-device temp memory of the pipelined train step as microbatches grow.

  python bench/pipeline_memory.py

Compiles (does not run) the tiny model's step on 8 simulated CPU devices
(pipeline=2 x data=4) with 2 sequences per device and microbatch, for
M = 4..32 microbatches, under every schedule (interleaved 1F1B with 2 chunks
per stage). Writes docs/pipeline.md's table and docs/pipeline_memory.png
(bench/pipeline_schedules.py draws the Gantt charts).
"""

import os
import sys
from pathlib import Path

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"

import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from meshtrain.analysis import hlo  # noqa: E402
from meshtrain.config import load  # noqa: E402
from meshtrain.planner.plan import compile_step  # noqa: E402
from meshtrain.train.setup import build  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
from report import write_section  # noqa: E402

MICROBATCHES = (4, 8, 16, 32)
SCHEDULES = {"gpipe": 1, "1f1b": 1, "interleaved_1f1b": 2, "zb_h1": 1, "zb_h2": 1}


def temp_mib(schedule, virtual, microbatches):
  cfg = load(REPO / "configs" / "tiny.py")
  cfg.mesh.update(data=4, pipeline=2)
  cfg.pipeline.update(schedule=schedule, microbatches=microbatches, virtual_stages=virtual)
  cfg.global_batch = 4 * 2 * microbatches
  return hlo.memory_bytes(compile_step(build(cfg)))["temp"] / 2**20


def main():
  temps = {}
  for name, virtual in SCHEDULES.items():
    for m in MICROBATCHES:
      print(f"compiling {name} M={m}", flush=True)
      temps[name, m] = temp_mib(name, virtual, m)
  fig, ax = plt.subplots(figsize=(6, 4))
  for name in SCHEDULES:
    ax.plot(MICROBATCHES, [temps[name, m] for m in MICROBATCHES], "o-", label=name)
  ax.set_xlabel("microbatches per step (2 sequences per device each)")
  ax.set_ylabel("temp MiB per device (compiled step)")
  ax.set_xscale("log", base=2)
  ax.set_xticks(MICROBATCHES, [str(m) for m in MICROBATCHES])
  ax.set_title("tiny model, pipeline=2 x data=4")
  ax.legend()
  fig.tight_layout()
  fig.savefig(REPO / "docs" / "pipeline_memory.png", dpi=110)
  table = ["| schedule | " + " | ".join(f"M={m}" for m in MICROBATCHES) + " | M=32 / M=4 |",
           "|---|" + "---|" * (len(MICROBATCHES) + 1)]
  for name in SCHEDULES:
    row = [temps[name, m] for m in MICROBATCHES]
    table.append(f"| {name} | " + " | ".join(f"{t:.2f}" for t in row) + f" | {row[-1] / row[0]:.2f} |")
  rows = [{"schedule": n, "microbatches": m, "temp_mib": t} for (n, m), t in temps.items()]
  write_section("pipeline_memory", rows, "Temp MiB per device.\n\n" + "\n".join(table),
                command="python bench/pipeline_memory.py", doc=REPO / "docs" / "pipeline.md")
  print("\n".join(table))


if __name__ == "__main__":
  main()
