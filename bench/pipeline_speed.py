"""The pipelined step against an earlier commit's, side by side on 8 simulated CPU devices.

    python bench/pipeline_speed.py [--ref b5ac717] [--rounds 3] [--steps 15]

The model of issue 29: a 4.3M-parameter Llama (vocab 256, width 256, 4
layers, 4 heads x 64, SwiGLU 1024, untied), sequence 128, global batch 16,
float32, remat none, pipeline=2 x data=4, 4 microbatches. Each measurement is
a fresh process that trains `--steps` steps and reports the mean step time
from step 5 on; the reference commit's code (a `git archive` of `--ref` in a
temporary directory) and this tree's run alternately, `--rounds` times, so
both see the same machine load. The ratio of medians is the result (a
ratio, not seconds: these machines are shared). Also read from this tree's
compiled step: temp memory, copy ops (static: loops times trips, every
branch), and the bytes copied per tick against one microbatch's activation
(`hlo.copy_bytes`, `hlo.loop_copy_bytes`). Results:
bench/results/pipeline_speed.json and the table in docs/pipeline.md.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODEL = dict(vocab_size=256, embed_dim=256, num_layers=4, num_heads=4, num_kv_heads=4,
             head_dim=64, mlp_dim=1024)

# Runs in a child process, against whichever tree is first on its path; uses
# only what both trees have (get_config, build, init_state, train_step).
WORKER = """
import json, os, sys, time
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
import jax, numpy as np
from meshtrain.config import get_config
from meshtrain.train.setup import build
schedule, steps, model = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
cfg = get_config()
cfg.model.update(model)
cfg.seq_len, cfg.global_batch, cfg.steps = 128, 16, steps
cfg.mesh.update(data=4, pipeline=2)
cfg.pipeline.update(schedule=schedule, microbatches=4)
setup = build(cfg)
state = setup.init_state()
rng = np.random.default_rng(0)
times, start = [], time.perf_counter()
for step in range(steps):
  tokens = rng.integers(0, 256, (16, 129), dtype=np.int32)
  batch = jax.device_put({"inputs": tokens[:, :-1], "targets": tokens[:, 1:]},
                         setup.train_step.batch_sharding)
  state, metrics = setup.train_step(state, batch)
  jax.block_until_ready(metrics)
  now = time.perf_counter()
  times.append(now - start)
  start = now
print(json.dumps({"step_s": sum(times[5:]) / len(times[5:]), "loss": float(metrics["loss"])}))
"""


def measure(tree: Path, schedule: str, steps: int) -> dict:
  env = {**os.environ, "PYTHONPATH": str(tree)}
  result = subprocess.run([sys.executable, "-c", WORKER, schedule, str(steps), json.dumps(MODEL)],
                          cwd=tree, env=env, capture_output=True, text=True, check=True)
  return json.loads(result.stdout.strip().splitlines()[-1])


def compiled_figures(schedule: str) -> dict:
  """Temp memory, copies, and copy bytes per tick of this tree's compiled step."""
  os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
  sys.path.insert(0, str(REPO))
  from meshtrain.analysis import hlo
  from meshtrain.config import get_config
  from meshtrain.planner.plan import compile_step
  from meshtrain.train.setup import build
  cfg = get_config()
  cfg.model.update(MODEL)
  cfg.seq_len, cfg.global_batch = 128, 16
  cfg.mesh.update(data=4, pipeline=2)
  cfg.pipeline.update(schedule=schedule, microbatches=4)
  compiled = compile_step(build(cfg))
  count, copied = hlo.copy_bytes(compiled)
  return {"temp_mib": hlo.memory_bytes(compiled)["temp"] / 2**20, "copy_ops": count,
          "copy_mib": copied / 2**20, "tick_copy_bytes": hlo.loop_copy_bytes(compiled),
          "activation_bytes": 1 * 128 * 256 * 4}  # one microbatch: 1 sequence per data replica


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--ref", default="b5ac717")
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--steps", type=int, default=15)
  args = parser.parse_args()
  rows = {}
  with tempfile.TemporaryDirectory() as ref_tree:
    archive = subprocess.run(["git", "archive", args.ref], cwd=REPO, capture_output=True,
                             check=True).stdout
    subprocess.run(["tar", "-x", "-C", ref_tree], input=archive, check=True)
    runs = [("ref 1f1b", Path(ref_tree), "1f1b"), ("1f1b", REPO, "1f1b"),
            ("zb_h1", REPO, "zb_h1"), ("gpipe", REPO, "gpipe")]
    for round_ in range(args.rounds):
      for name, tree, schedule in runs:
        result = measure(tree, schedule, args.steps)
        rows.setdefault(name, []).append(result)
        print(f"round {round_}: {name:9s} {result['step_s']:.3f} s/step, loss {result['loss']:.4f}",
              flush=True)
  median = {name: statistics.median(r["step_s"] for r in results) for name, results in rows.items()}
  compiled = {s: compiled_figures(s) for s in ("1f1b", "zb_h1", "gpipe")}
  table = ["| step | median s/step | runs | / b5ac717's 1F1B | temp MiB | copies | copied per tick |",
           "|---|---|---|---|---|---|---|"]
  for name, results in rows.items():
    c = compiled.get(name)
    figures = (f"{c['temp_mib']:.1f} | {c['copy_ops']} | "
               f"{c['tick_copy_bytes'] / c['activation_bytes']:.0f} activations" if c else "| |")
    times = ", ".join(f"{r['step_s']:.3f}" for r in results)
    table.append(f"| {name} | {median[name]:.3f} | {times} | "
                 f"{median[name] / median['ref 1f1b']:.2f} | {figures} |")
  sys.path.insert(0, str(REPO / "bench"))
  import report
  report.write_section("pipeline_speed", [{"name": n, "runs": r, "median_step_s": median[n],
                                           "compiled": compiled.get(n)} for n, r in rows.items()],
                       "\n".join(table), "python bench/pipeline_speed.py " + " ".join(sys.argv[1:]),
                       doc=REPO / "docs" / "pipeline.md")
  print("\n".join(table))


if __name__ == "__main__":
  main()
