"""Float8 training against bfloat16 on the shakespeare text: loss after equal
steps, and the step's speed on this CPU, in one process.

  python bench/float8.py [--steps 300]

Trains a 0.1M-parameter Llama on 8 simulated CPU devices (fsdp=8) in
bfloat16 and with each `config.float8` recipe (bfloat16 elsewhere), the same
batches and initial weights. Writes its table into docs/benchmarks.md and
docs/float8_loss.png. The CPU has no float8 units: its speed says what the
quantization costs there, not what a GPU gains (docs/float8.md).
"""

import argparse
import os
import sys
import tempfile
from pathlib import Path

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"

import matplotlib  # noqa: E402
import numpy as np  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from meshtrain.train.loop import train  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
from report import write_section  # noqa: E402
from shakespeare import WINDOW, config, final_loss, smoothed  # noqa: E402

RUNS = {"bfloat16": "none", "float8 tensorwise": "tensorwise", "float8 rowwise": "rowwise",
        "float8 blockwise": "blockwise"}


def draw(rows, path):
  fig, (curve_ax, gap_ax) = plt.subplots(1, 2, figsize=(11, 4))
  steps = np.arange(WINDOW, len(rows[0]["losses"]) + 1)
  smooth = {row["run"]: smoothed(row["losses"]) for row in rows}
  base = smooth[rows[0]["run"]]
  for run, losses in smooth.items():
    curve_ax.plot(steps, losses, label=run)
    gap_ax.plot(steps, 100 * (losses / base - 1), label=run)
  curve_ax.set_xlabel("step (32 x 64 tokens each)")
  curve_ax.set_ylabel(f"training loss ({WINDOW}-step mean)")
  curve_ax.legend()
  gap_ax.axhline(2, color="grey", linestyle=":", label="the issue's bound (2%)")
  gap_ax.set_xlabel("step")
  gap_ax.set_ylabel("loss against bfloat16's (%)")
  gap_ax.legend()
  fig.suptitle("0.1M-parameter Llama on shakespeare, fsdp=8 (simulated CPU devices)")
  fig.tight_layout()
  fig.savefig(path, dpi=110)


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--steps", type=int, default=300)
  args = parser.parse_args()
  rows = []
  with tempfile.TemporaryDirectory() as tmp:
    for name, recipe in RUNS.items():
      print(f"training {name}", flush=True)
      records = train(config(args.steps, f"{tmp}/{len(rows)}", {"fsdp": 8}, {
          "compute_dtype": "bfloat16", "param_dtype": "bfloat16", "float8": recipe}))
      speeds = [r["tokens_per_sec"] for r in records[len(records) // 2:] if r["tokens_per_sec"]]
      losses = [r["loss"] for r in records]
      rows.append({"run": name, "losses": losses, "final_loss": final_loss(losses),
                   "tokens_per_sec": float(np.median(speeds))})
  base = rows[0]
  table = ["| run | final loss | vs bfloat16 | tokens/s on this CPU | vs bfloat16 |",
           "|---|---|---|---|---|"]
  for row in rows:
    table.append(f"| {row['run']} | {row['final_loss']:.4f} | "
                 f"{row['final_loss'] / base['final_loss'] - 1:+.2%} | "
                 f"{row['tokens_per_sec']:,.0f} | "
                 f"{row['tokens_per_sec'] / base['tokens_per_sec']:.2f}x |")
  draw(rows, REPO / "docs" / "float8_loss.png")
  write_section("float8", rows, f"{args.steps} steps of 32 x 64 tokens; final loss is the mean "
                f"of the last {WINDOW} steps; tokens/s the median of the second half.\n\n"
                + "\n".join(table), command=f"python bench/float8.py --steps {args.steps}")
  print("\n".join(table))


if __name__ == "__main__":
  main()
