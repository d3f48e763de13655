"""Per-device memory of each ZeRO stage on the small config: compiled vs analytic.

  python bench/zero_memory.py

Compiles (does not run) the train step of the small model on 8 simulated CPU
devices for each stage, reads `memory_analysis()`, and puts it beside
`meshtrain plan`'s analytic model. Writes docs/zero.md's table and
docs/zero_memory.png.
"""

import os
import sys
from pathlib import Path

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"

import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from meshtrain.config import load  # noqa: E402
from meshtrain.planner.plan import plan  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
from report import write_section  # noqa: E402

STAGES = {
    "zero 0 (DDP)": dict(mesh=dict(data=8), zero_stage=0),
    "zero 1": dict(mesh=dict(data=8), zero_stage=1),
    "zero 2": dict(mesh=dict(data=8), zero_stage=2),
    "zero 3": dict(mesh=dict(data=8), zero_stage=3),
    "fsdp=8": dict(mesh=dict(data=1, fsdp=8)),
    # Stage 2 differs from stage 1 only in the gradient accumulator:
    "zero 1, accumulate 2": dict(mesh=dict(data=8), zero_stage=1, grad_accum_steps=2),
    "zero 2, accumulate 2": dict(mesh=dict(data=8), zero_stage=2, grad_accum_steps=2),
}
MIB = 2**20


def stage_report(changes):
  cfg = load(REPO / "configs" / "small.py")
  cfg.update(changes)  # nested dicts update sub-configs key by key
  return plan(cfg, 8, compile_step=True)


def draw(rows, path):
  names = [row["stage"] for row in rows]
  fig, (state_ax, total_ax) = plt.subplots(1, 2, figsize=(11, 4))
  parts = ("params", "grads", "optimizer")
  bottom = [0.0] * len(rows)
  for part in parts:
    values = [row["analytic"][part] / MIB for row in rows]
    state_ax.bar(names, values, bottom=bottom, label=f"analytic {part}")
    bottom = [b + v for b, v in zip(bottom, values)]
  state_ax.set_xticks(range(len(names)), names, ha="right")
  state_ax.plot(names, [row["measured"]["arguments"] / MIB for row in rows], "kD",
                label="measured: state held between steps")
  state_ax.set_title("weights, gradients, optimizer state per device")
  state_ax.set_ylabel("MiB")
  state_ax.legend(fontsize=8)
  width = 0.4
  x = range(len(rows))
  total_ax.bar([i - width / 2 for i in x], [row["analytic"]["total"] / MIB for row in rows],
               width, label="analytic total")
  total_ax.bar([i + width / 2 for i in x], [row["measured"]["total"] / MIB for row in rows],
               width, label="measured total (arguments + temp)")
  total_ax.set_xticks(list(x), names, ha="right")
  total_ax.set_title("whole step per device")
  total_ax.legend(fontsize=8)
  for ax in (state_ax, total_ax):
    ax.tick_params(axis="x", labelsize=8, labelrotation=25)
  fig.suptitle("small model (20M) on 8 simulated devices, float32, batch 32 x 256")
  fig.tight_layout()
  fig.savefig(path, dpi=110)


def main():
  rows = []
  for stage, changes in STAGES.items():
    print(f"compiling {stage}", flush=True)
    report = stage_report(changes)
    rows.append({"stage": stage, "analytic": report["analytic"]["memory_bytes"],
                 "measured": report["measured"]["memory_bytes"]})
  table = ["| stage | params | grads | optimizer | activations | analytic total | "
           "measured state (arguments) | measured temp | measured total |",
           "|---|---|---|---|---|---|---|---|---|"]
  for row in rows:
    a, m = row["analytic"], row["measured"]
    table.append(f"| {row['stage']} | " + " | ".join(
        f"{v / MIB:.1f}" for v in (a["params"], a["grads"], a["optimizer"], a["activations"],
                                   a["total"], m["arguments"], m["temp"], m["total"])) + " |")
  draw(rows, REPO / "docs" / "zero_memory.png")
  write_section("zero_memory", rows, "MiB per device.\n\n" + "\n".join(table),
                command="python bench/zero_memory.py", doc=REPO / "docs" / "zero.md")
  print("\n".join(table))


if __name__ == "__main__":
  main()
