"""Local SGD / DiLoCo against DDP on the shakespeare text: loss at equal tokens
and bytes over `data` per step.

  python bench/local_sgd.py [--steps 200]

Trains a 0.1M-parameter Llama on 8 simulated CPU devices (data=8, AdamW inside) as DDP
and as DiLoCo with H = 1, 4, 16 inner steps (outer Nesterov, lr 0.7, momentum
0.9), plus H = 1 with outer SGD at rate 1 (plain averaging: the gap to DDP is
AdamW's per-replica moments). Bytes over `data` per step are read from the
compiled programs (the DDP step; local SGD's inner step, and its sync step / H)
beside the analytic ring figure of `meshtrain plan`. Writes docs/local_sgd.md's
table and docs/local_sgd.png.
"""

import argparse
import os
import sys
import tempfile
from pathlib import Path

os.environ["XLA_FLAGS"] = ("--xla_force_host_platform_device_count=8"
                           " --xla_backend_optimization_level=0")  # compiles faster; nothing is timed

import jax  # noqa: E402
import matplotlib  # noqa: E402
import matplotlib.ticker  # noqa: E402
import numpy as np  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from meshtrain.analysis import hlo  # noqa: E402
from meshtrain.planner.plan import compile_step, plan  # noqa: E402
from meshtrain.train.loop import train  # noqa: E402
from meshtrain.train.setup import build  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
from report import write_section  # noqa: E402
from shakespeare import WINDOW, config, final_loss, smoothed  # noqa: E402

DILOCO = {"local_sgd.outer_optimizer": "nesterov", "local_sgd.outer_learning_rate": 0.7,
          "local_sgd.outer_momentum": 0.9}
RUNS = {
    "DDP": {},
    "DiLoCo H=1": {"local_sgd.inner_steps": 1, **DILOCO},
    "DiLoCo H=4": {"local_sgd.inner_steps": 4, **DILOCO},
    "DiLoCo H=16": {"local_sgd.inner_steps": 16, **DILOCO},
    "averaging H=1": {"local_sgd.inner_steps": 1, "local_sgd.outer_optimizer": "sgd",
                      "local_sgd.outer_learning_rate": 1.0},
}


def data_bytes(setup) -> float:
  """Bytes one device sends over `data` per step, from the compiled programs."""
  over_data = lambda program: sum(c.bytes for c in hlo.collectives(program, setup.mesh)
                                  if "data" in c.axis)
  step = over_data(compile_step(setup))
  inner_steps = setup.cfg.local_sgd.inner_steps
  if not inner_steps:
    return step
  abstract = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                          setup.abstract_state(), setup.shardings)
  return step + over_data(setup.train_step.lower_sync(abstract).compile()) / inner_steps


def analytic_bytes(cfg) -> float:
  return sum(c["bytes"] for c in plan(cfg, 8, compile_step=False)["analytic"]["collectives"]
             if "data" in c["axis"])


def draw(rows, path):
  fig, (curve_ax, cost_ax) = plt.subplots(1, 2, figsize=(11, 4))
  for row in rows:
    losses = smoothed(row["losses"])
    tokens = np.arange(WINDOW, len(row["losses"]) + 1) * row["tokens_per_step"]
    curve_ax.plot(tokens / 1e6, losses, label=row["run"])
  curve_ax.set_xlabel("tokens (millions), equal for every run")
  curve_ax.set_ylabel(f"training loss ({WINDOW}-step mean)")
  curve_ax.set_title("convergence")
  curve_ax.legend(fontsize=8)
  for row in rows:
    cost_ax.scatter(row["compiled_mib_per_step"], row["final_loss"], s=40)
    cost_ax.annotate(row["run"], (row["compiled_mib_per_step"], row["final_loss"]), fontsize=8,
                     xytext=(4, 4), textcoords="offset points")
  cost_ax.set_xscale("log")
  cost_ax.xaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
  cost_ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
  cost_ax.set_xlabel("MiB sent over `data` per device per step (compiled)")
  cost_ax.set_ylabel(f"final loss ({WINDOW}-step mean)")
  cost_ax.set_title("loss against communication")
  fig.suptitle("0.1M-parameter Llama on shakespeare, 8 simulated devices (data=8), AdamW inside")
  fig.tight_layout()
  fig.savefig(path, dpi=110)


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--steps", type=int, default=200)
  args = parser.parse_args()
  rows = []
  with tempfile.TemporaryDirectory() as tmp:
    for name, changes in RUNS.items():
      print(f"training {name}", flush=True)
      cfg = config(args.steps, f"{tmp}/{len(rows)}", {"data": 8}, changes)
      losses = [r["loss"] for r in train(cfg)]
      rows.append({"run": name, "losses": losses, "final_loss": final_loss(losses),
                   "tokens_per_step": cfg.global_batch * cfg.seq_len,
                   "compiled_mib_per_step": data_bytes(build(cfg)) / 2**20,
                   "analytic_mib_per_step": analytic_bytes(cfg) / 2**20})
  ddp = rows[0]["final_loss"]
  table = ["| run | final loss | vs DDP | MiB over data per step (compiled) | (analytic) |",
           "|---|---|---|---|---|"]
  for row in rows:
    table.append(f"| {row['run']} | {row['final_loss']:.4f} | {row['final_loss'] - ddp:+.4f} | "
                 f"{row['compiled_mib_per_step']:.3f} | {row['analytic_mib_per_step']:.3f} |")
  draw(rows, REPO / "docs" / "local_sgd.png")
  write_section("local_sgd", rows, f"{args.steps} steps of 32 x 64 tokens; final loss is the mean "
                f"of the last {WINDOW} steps.\n\n" + "\n".join(table),
                command=f"python bench/local_sgd.py --steps {args.steps}",
                doc=REPO / "docs" / "local_sgd.md")
  print("\n".join(table))


if __name__ == "__main__":
  main()
