"""Every pipeline schedule side by side: bubble, in-flight, compiled FLOPs, temp.

  python bench/pipeline_schedules.py

For P = 4 and 8 stages and M = 8 and 32 microbatches, on 8 simulated CPU
devices (pipeline=P x data=8/P), the micro Llama with one layer per chunk and
one sequence per device and microbatch. Per schedule:
  - bubble: the paper's formula (Qi et al. 2023; F = B = W) beside the
    measured share of idle ticks of the table the executor runs;
  - in flight per stage (microbatch-chunks awaiting B; Megatron's count);
  - compiled matmul FLOPs of the train step over the unpipelined step's
    (`tests/compiled_flops.py`: loop bodies times trips, each tick's
    conditionals weighted by the table, `runtime.cond_weights`), both on 8
    devices, remat=none;
  - compiled temp MiB per device.
Writes docs/pipeline.md's table and the Gantt charts of P=4, M=8.
"""

import os
import sys
from pathlib import Path

# LLVM at -O0 compiles faster; nothing here is timed.
os.environ["XLA_FLAGS"] = ("--xla_force_host_platform_device_count=8"
                           " --xla_backend_optimization_level=0")

import matplotlib  # noqa: E402

matplotlib.use("Agg")

from meshtrain.analysis import hlo  # noqa: E402
from meshtrain.config import get_config  # noqa: E402
from meshtrain.parallel.pipeline import draw, measures, runtime, schedule as schedules  # noqa: E402
from meshtrain.planner.plan import compile_step  # noqa: E402
from meshtrain.train.setup import build  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "bench"), str(REPO / "tests")]  # compiled_flops: a tool the tests share
import compiled_flops  # noqa: E402
from report import write_section  # noqa: E402

SIZES = [(4, 8), (4, 32), (8, 8), (8, 32)]
SCHEDULES = {"gpipe": 1, "1f1b": 1, "interleaved_1f1b": 2, "zb_h1": 1, "zb_h2": 1}
MICRO = dict(model=dict(vocab_size=64, embed_dim=32, num_heads=4, num_kv_heads=2, head_dim=8,
                        mlp_dim=64), seq_len=16)


def config(p, m, layers, **changes):
  cfg = get_config()
  cfg.update(MICRO)
  cfg.model.num_layers = layers
  cfg.mesh.update(data=8 // p, pipeline=p)
  cfg.global_batch = (8 // p) * m
  cfg.update(changes)
  return cfg


def measure(name, virtual, p, m):
  cfg = config(p, m, p * virtual, pipeline=dict(schedule=name, microbatches=m,
                                                virtual_stages=virtual))
  compiled = compile_step(build(cfg))
  table = schedules.build(name, p, m, virtual)
  weights = runtime.cond_weights(table)
  return compiled_flops.dot_flops(compiled, weights), hlo.memory_bytes(compiled)["temp"] / 2**20


def plain_flops(p, m, layers):
  cfg = config(p, m, layers)
  cfg.mesh.update(data=8, pipeline=1)
  return compiled_flops.dot_flops(compile_step(build(cfg)))


def main():
  rows = []
  for p, m in SIZES:
    plain = {v: plain_flops(p, m, p * v) for v in set(SCHEDULES.values())}
    for name, virtual in SCHEDULES.items():
      print(f"compiling {name} P={p} M={m}", flush=True)
      table = schedules.build(name, p, m, virtual)
      summary = measures.describe(table)
      flops, temp = measure(name, virtual, p, m)
      rows.append({"schedule": name, "P": p, "M": m, "V": virtual,
                   "paper_bubble": summary["paper_bubble_fraction"],
                   "tick_bubble": summary["tick_bubble_fraction"], "ticks": summary["ticks"],
                   "in_flight": summary["peak_in_flight"],
                   "flops_ratio": flops / plain[virtual], "temp_mib": temp})
  for name, virtual in SCHEDULES.items():
    draw.draw_gantt(schedules.build(name, 4, 8, virtual), REPO / "docs" / f"schedule_{name}.png")
  lines = ["| P | M | schedule | bubble, paper | bubble, measured ticks | ticks | in flight per stage"
           " | FLOPs / unpipelined | temp MiB |", "|---|---|---|---|---|---|---|---|---|"]
  for row in rows:
    lines.append(f"| {row['P']} | {row['M']} | {row['schedule']} | {row['paper_bubble']:.3f} | "
                 f"{row['tick_bubble']:.3f} | {row['ticks']} | {row['in_flight']} | "
                 f"{row['flops_ratio']:.3f} | {row['temp_mib']:.2f} |")
  write_section("pipeline_schedules", rows, "\n".join(lines),
                command="python bench/pipeline_schedules.py", doc=REPO / "docs" / "pipeline.md")
  print("\n".join(lines))


if __name__ == "__main__":
  main()
