"""Step time of the real training loop as a ratio of the bare compiled step, in one process.

  python bench/loop.py [--steps 11] [--rounds 2] [--bare-steps 3]

Runs `meshtrain.train.loop.train` on the small model (global batch 8 x 128
tokens) on 8 simulated CPU devices with all it does around the step: a batch
from grain and `to_global` each step, metrics fetched, written (jsonl,
TensorBoard) and shown (tqdm) every `log_every` steps, async checkpoints into a
temporary workdir. The reference is the same step compiled once and called back
to back on one batch already on the devices, as bench/strategies.py times it.
Each loop setting runs `rounds` times between blocks of a few bare steps and is
compared with the blocks either side, so that a slow spell of the shared machine
hits both alike. A loop's time is its mean step after the first (which
compiles), from its records' `step_time_s`; a ratio is the median of rounds.

Also counts what XLA compiles during each loop run, and times `next(batches)` +
`to_global` back to back: with grain's prefetch empty, the most a batch can add
to a step. Writes bench/results/loop.json and the table between the markers in
docs/benchmarks.md.
"""

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"

import jax  # noqa: E402
import numpy as np  # noqa: E402

from meshtrain.data import make_iterator  # noqa: E402
from meshtrain.train.loop import to_global, train  # noqa: E402
from meshtrain.train.setup import build  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
import strategies  # noqa: E402
from report import write_section  # noqa: E402

TEXT = dict(source="text", path=str(REPO.parent / "shared" / "data" / "tinyshakespeare.txt"))
SYNTHETIC = dict(source="synthetic")
SETTINGS = {  # name -> config changes
    "log every 10, text": dict(log_every=10, data=TEXT),
    "log every step, text": dict(log_every=1, data=TEXT),
    "log every 10, text, checkpoint every 5": dict(log_every=10, data=TEXT,
                                                   checkpoint=dict(every_steps=5)),
    "log every 10, synthetic": dict(log_every=10, data=SYNTHETIC),
}

COMPILES = []  # (function name, seconds) of each XLA compilation, in order


def _record_compile(event, duration_s, fun_name="", **_):
  if event == "/jax/core/compile/backend_compile_duration":
    COMPILES.append((fun_name, duration_s))


jax.monitoring.register_event_duration_secs_listener(_record_compile)


def small_config(changes):
  """The strategies table's model and batch; checkpoints only at the last step."""
  return strategies.small_config({"checkpoint": dict(every_steps=0), **changes})


class BareStep:
  """The compiled step called back to back on one batch already on the devices."""

  def __init__(self):
    cfg = small_config({})
    self.setup = build(cfg)
    self.state = self.setup.init_state()
    self.batch = to_global(next(batch_iterator(cfg)), self.setup.train_step.batch_sharding)
    self.dispatch_s = []  # until the call returns; the step then runs on asynchronously
    self.timed(1)  # compiles
    self.dispatch_s.clear()

  def timed(self, steps: int) -> float:
    """Mean seconds per step, each waited for."""
    total = 0.0
    for _ in range(steps):
      start = time.perf_counter()
      self.state, metrics = self.setup.train_step(self.state, self.batch)
      self.dispatch_s.append(time.perf_counter() - start)
      jax.block_until_ready(metrics)
      total += time.perf_counter() - start
    return total / steps


def batch_iterator(cfg):
  return make_iterator(cfg.data, seq_len=cfg.seq_len, global_batch=cfg.global_batch,
                       vocab_size=cfg.model.vocab_size, seed=cfg.seed)


def batch_s(cfg, sharding, batches: int = 20) -> float:
  """Median seconds of `next(batches)` + `to_global`, called back to back."""
  iterator = batch_iterator(cfg)
  jax.block_until_ready(to_global(next(iterator), sharding))  # reads the file, starts the threads
  times = []
  for _ in range(batches):
    start = time.perf_counter()
    jax.block_until_ready(to_global(next(iterator), sharding))
    times.append(time.perf_counter() - start)
  return float(np.median(times))


def loop_step_s(cfg) -> tuple[float, list[tuple[str, float]]]:
  """Mean step of `train(cfg)` after the first, and what XLA compiled during the run."""
  compiled = len(COMPILES)
  with tempfile.TemporaryDirectory() as workdir:
    cfg.workdir = workdir
    records = train(cfg)
  first, last = records[0], records[-1]
  seconds = sum(r["step_time_s"] * (r["step"] - before["step"])
                for before, r in zip(records, records[1:]))
  return seconds / (last["step"] - first["step"]), COMPILES[compiled:]


def by_function(compiles) -> dict[str, dict]:
  """(name, seconds) pairs -> {name: {"count", "seconds"}}, in order of first compilation."""
  summary = {}
  for name, seconds in compiles:
    entry = summary.setdefault(name, {"count": 0, "seconds": 0.0})
    entry["count"] += 1
    entry["seconds"] += seconds
  return summary


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--steps", type=int, default=11, help="steps per loop run")
  parser.add_argument("--rounds", type=int, default=2)
  parser.add_argument("--bare-steps", type=int, default=3, help="bare steps between loop runs")
  args = parser.parse_args()
  bare = BareStep()
  sharding = bare.setup.train_step.batch_sharding
  runs = {name: [] for name in SETTINGS}  # name -> [(loop / bare, loop s, compiles)] per round
  bare_s = [bare.timed(args.bare_steps)]
  for round_ in range(args.rounds):
    for name, changes in SETTINGS.items():
      print(f"round {round_ + 1}: {name}", flush=True)
      loop_s, compiles = loop_step_s(small_config({**changes, "steps": args.steps}))
      bare_s.append(bare.timed(args.bare_steps))
      runs[name].append((loop_s / np.mean(bare_s[-2:]), loop_s, compiles))  # bare steps either side
  rows = []
  for name, changes in SETTINGS.items():
    ratios = [ratio for ratio, _, _ in runs[name]]
    other = by_function(c for _, _, run in runs[name] for c in run if c[0] != "jit(step)")
    batch = batch_s(small_config(changes), sharding)
    rows.append({
        "setting": name, "step_time_ratio": float(np.median(ratios)), "step_time_ratios": ratios,
        "loop_step_s": float(np.median([loop for _, loop, _ in runs[name]])),
        "train_step_compiles_per_run": [[n for n, _ in run].count("jit(step)")
                                        for _, _, run in runs[name]],
        "other_compiles": other, "batch_s": batch, "batch_ratio": batch / np.median(bare_s)})
  table = ["| loop setting | loop step / bare step (rounds' range) | train step compiles per run "
           "| other compiles, all rounds | next(batches) + to_global |",
           "|---|---|---|---|---|"]
  table += [f"| {r['setting']} | {r['step_time_ratio']:.2f} ({min(r['step_time_ratios']):.2f}-"
            f"{max(r['step_time_ratios']):.2f}) | "
            f"{', '.join(map(str, r['train_step_compiles_per_run']))} | "
            + ", ".join(f"{fun} x{c['count']} ({c['seconds']:.1f} s)"
                        for fun, c in r["other_compiles"].items()) +
            f" | {r['batch_s'] * 1e3:.2f} ms = {r['batch_ratio']:.3%} of a step |" for r in rows]
  table.append(f"\nBare step: {np.median(bare_s):.2f} s (median of blocks); its call returns after "
               f"{np.median(bare.dispatch_s) * 1e3:.1f} ms (median) and the step runs on.")
  write_section("loop", rows, "\n".join(table),
                command=f"python bench/loop.py --steps {args.steps} --rounds {args.rounds} "
                        f"--bare-steps {args.bare_steps}")
  print("\n".join(table))


if __name__ == "__main__":
  main()
