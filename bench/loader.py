"""The prepared-corpus loader's time per batch as a share of the tiny model's step.

  python bench/loader.py [--batches 50] [--steps 20]

On one CPU device (configs/shakespeare_bpe.py's setting: the tiny model, a
1024-id BPE of the play) and on 8 simulated devices (data=8): the median of
`next(batches)` + `to_global` called back to back, for packing `concat` and
`segments` (which adds segment ids and positions), against the median of the
compiled train step called back to back on one batch already on the devices.
Back to back, grain's prefetch is empty, so this is the most a batch can add
to a step; in the loop the batches are made in grain's threads while the step
runs. Writes bench/results/loader.json and the table between the markers in
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

from meshtrain import config  # noqa: E402
from meshtrain.data import make_iterator  # noqa: E402
from meshtrain.data.placement import to_global  # noqa: E402
from meshtrain.data.prepare import prepare  # noqa: E402
from meshtrain.train.setup import build  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
from report import write_section  # noqa: E402

SHAKESPEARE = REPO.parent / "shared" / "data" / "tinyshakespeare.txt"


def median_s(fn, count: int) -> float:
  jax.block_until_ready(fn())  # compiles, reads the file, starts the threads
  times = []
  for _ in range(count):
    start = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - start)
  return float(np.median(times))


def measure(corpus: Path, devices: int, args) -> list[dict]:
  cfg = config.get_config()
  cfg.data.update(source="tokens", path=str(corpus))
  cfg.model.vocab_size = 1024
  setup = build(cfg, jax.devices()[:devices])
  sharding = setup.train_step.batch_sharding
  shape = (cfg.global_batch, cfg.seq_len)
  state = setup.init_state()
  batch = to_global(next(make_iterator(cfg.data, seq_len=cfg.seq_len, global_batch=cfg.global_batch,
                                       vocab_size=1024, seed=0)), sharding, shape)

  def step():
    nonlocal state
    state, metrics = setup.train_step(state, batch)
    return metrics

  step_s = median_s(step, args.steps)
  rows = []
  for packing in ("concat", "segments"):
    cfg.data.packing = packing
    batches = make_iterator(cfg.data, seq_len=cfg.seq_len, global_batch=cfg.global_batch,
                            vocab_size=1024, seed=0)
    batch_s = median_s(lambda: to_global(next(batches), sharding, shape), args.batches)
    rows.append({"devices": devices, "packing": packing, "batch_s": batch_s, "step_s": step_s,
                 "share": batch_s / step_s})
  return rows


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--batches", type=int, default=50)
  parser.add_argument("--steps", type=int, default=20)
  args = parser.parse_args()
  with tempfile.TemporaryDirectory() as tmp:
    corpus = Path(tmp) / "shakespeare"
    prepare([str(SHAKESPEARE)], "train:1024", str(corpus))
    rows = measure(corpus, 1, args) + measure(corpus, 8, args)
  table = "\n".join(
      ["| devices | packing | next(batches) + to_global | tiny train step | share of the step |",
       "|---|---|---|---|---|"] +
      [f"| {r['devices']} | {r['packing']} | {r['batch_s'] * 1e3:.2f} ms | {r['step_s'] * 1e3:.1f} ms "
       f"| {r['share']:.2%} |" for r in rows])
  write_section("loader", rows, table,
                command=f"python bench/loader.py --batches {args.batches} --steps {args.steps}")
  print(table)


if __name__ == "__main__":
  main()
