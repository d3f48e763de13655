"""Step time of each strategy as a ratio of a plain-JAX data-parallel step, in one process.

  python bench/strategies.py [--steps 4] [--rounds 3]

Runs the small model (global batch 8 x 128 tokens, so a step takes seconds on
2 cores) on 8 simulated CPU devices: two baselines written without meshtrain's
rules or step (the same model and optax optimizer under plain `jax.jit`: on one
device, and with `NamedSharding` over 8 devices, batch split, weights
replicated), then meshtrain under every strategy. Each is compiled once; then
they take turns, `rounds` times, so that a slow spell of the shared machine hits
them all alike; a time is the median step. Then each profiles one step
(`tests/op_trace.py`) for the collective bytes it ran (not every branch
of the compiled program). Writes bench/results/strategies.json
and the table between the markers in docs/benchmarks.md.
"""

import argparse
import os
import sys
import time
from pathlib import Path

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

from meshtrain.analysis import hlo  # noqa: E402
from meshtrain.config import load  # noqa: E402
from meshtrain.data import make_iterator  # noqa: E402
from meshtrain.planner.plan import analytic  # noqa: E402
from meshtrain.train.loop import to_global  # noqa: E402
from meshtrain.train.setup import build  # noqa: E402
from meshtrain.train.state import merged  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "bench"), str(REPO / "tests")]  # op_trace: a tool the tests share
import op_trace  # noqa: E402
from report import write_section  # noqa: E402

STRATEGIES = {  # name -> config changes
    "dp (zero 0)": dict(mesh=dict(data=8)),
    "zero1": dict(mesh=dict(data=8), zero_stage=1),
    "zero2": dict(mesh=dict(data=8), zero_stage=2),
    "zero3": dict(mesh=dict(data=8), zero_stage=3),
    "fsdp": dict(mesh=dict(data=1, fsdp=8)),
    "hsdp (data 2 x fsdp 4)": dict(mesh=dict(data=2, fsdp=4)),
    "tp (data 2 x tensor 4)": dict(mesh=dict(data=2, tensor=4)),
    "tp + sp": dict(mesh=dict(data=2, tensor=4), tensor_sequence_parallel=True),
    **{f"cp {s} (data 2 x sequence 4)": dict(mesh=dict(data=2, sequence=4),
                                            attention=dict(sequence_strategy=s))
       for s in ("all_gather_kv", "ulysses", "ring")},
    **{f"pp {s} (data 4 x pipeline 2, 2 microbatches)": dict(
        mesh=dict(data=4, pipeline=2), pipeline=dict(schedule=s, microbatches=2))
       for s in ("gpipe", "1f1b")},
    "3d (data 2 x pipeline 2 x tensor 2, sp)": dict(
        mesh=dict(data=2, pipeline=2, tensor=2), tensor_sequence_parallel=True,
        pipeline=dict(microbatches=2)),
}


def small_config(changes):
  cfg = load(REPO / "configs" / "small.py")
  cfg.update(global_batch=8, seq_len=128)
  cfg.update(changes)  # nested dicts update sub-configs key by key
  return cfg


class PlainRunner:
  """The baseline: `cfg`'s model and optimizer stepped by plain `jax.jit`, no
  rules and no meshtrain step; the batch split over `devices`, the weights
  replicated. `spec` replaces the model by another of the same weights (a
  plain loop over experts)."""

  def __init__(self, devices, cfg, spec=None):
    setup = build(cfg)
    spec, optimizer = spec or setup.spec, setup.optimizer
    mesh = Mesh(np.array(devices), ("batch",))
    replicated = NamedSharding(mesh, P())
    initial = jax.device_get(setup.init_state())
    params, model_state = jax.device_put((initial.params, initial.model_state), replicated)
    self.state = (params, jax.jit(optimizer.init, out_shardings=replicated)(params))
    batches = make_iterator(cfg.data, seq_len=cfg.seq_len, global_batch=cfg.global_batch,
                            vocab_size=cfg.model.vocab_size, seed=0)
    self.batch = jax.device_put(next(batches), NamedSharding(mesh, P("batch")))

    def step(state, batch):
      params, opt_state = state
      def loss_fn(p):
        logits = merged(spec, p, model_state)(batch["inputs"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()
      loss, grads = jax.value_and_grad(loss_fn)(params)
      updates, opt_state = optimizer.update(grads, opt_state, params)
      return (optax.apply_updates(params, updates), opt_state), loss

    self._step = jax.jit(step, donate_argnums=0)
    start = time.perf_counter()
    compiled = self._step.lower(self.state, self.batch).compile()
    self.compile_s = time.perf_counter() - start
    self.analytic_bytes = None  # no rules to model
    self.compiled, self.mesh = compiled, mesh
    self.step()
    self.times = []

  def step(self):
    self.state, loss = self._step(self.state, self.batch)
    jax.block_until_ready(loss)

  def collective_bytes(self) -> int:
    """Bytes per device of one step as it ran: a profiled step, so that a
    pipeline's tick, a conditional, counts only the branch it took."""
    executed = op_trace.executions(self.step, self.compiled, self.mesh.size)
    return sum(c.bytes for c in hlo.collectives(self.compiled, self.mesh, executed))

  def timed(self, steps):
    for _ in range(steps):
      start = time.perf_counter()
      self.step()
      self.times.append(time.perf_counter() - start)


class Runner(PlainRunner):
  """`cfg` trained by meshtrain: compiled step, its state and data, and its step times."""

  def __init__(self, cfg):
    self.setup = build(cfg)
    self.state = self.setup.init_state()
    batches = make_iterator(cfg.data, seq_len=cfg.seq_len, global_batch=cfg.global_batch,
                            vocab_size=cfg.model.vocab_size, seed=0)
    self.batch = to_global(next(batches), self.setup.train_step.batch_sharding)
    start = time.perf_counter()
    compiled = self.setup.train_step.lower(self.state, self.batch).compile()
    self.compile_s = time.perf_counter() - start
    self.analytic_bytes = sum(c["bytes"] for c in analytic(
        cfg, self.setup.spec, self.setup.rules, self.setup.mesh)["collectives"])
    self.compiled, self.mesh = compiled, self.setup.mesh
    self.step()  # the jitted call compiles once more from its own cache
    self.times = []

  def step(self):
    self.state, metrics = self.setup.train_step(self.state, self.batch)
    jax.block_until_ready(metrics)


def time_in_turns(runners: dict, steps: int, rounds: int) -> dict:
  """Times the runners taking turns, `steps` steps each per round; returns
  each one's collective bytes of a step as it ran (profiled after timing)."""
  for round_ in range(rounds):
    for name, runner in runners.items():
      print(f"round {round_ + 1}: {name}", flush=True)
      runner.timed(steps)
  return {name: runner.collective_bytes() for name, runner in runners.items()}


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--steps", type=int, default=4)
  parser.add_argument("--rounds", type=int, default=3)
  args = parser.parse_args()
  runners = {"plain jax, data 8 (baseline)": PlainRunner(jax.devices(), small_config({})),
             "plain jax, 1 device": PlainRunner(jax.devices()[:1], small_config({}))}
  for name, changes in STRATEGIES.items():
    print(f"compiling {name}", flush=True)
    runners[name] = Runner(small_config(changes))
  measured = time_in_turns(runners, args.steps, args.rounds)
  baseline = np.median(runners["plain jax, data 8 (baseline)"].times)
  dp = np.median(runners["dp (zero 0)"].times)
  rows = [{"strategy": name, "step_time_ratio": float(np.median(r.times) / baseline),
           "step_time_ratio_to_dp": float(np.median(r.times) / dp),
           "step_time_s": float(np.median(r.times)), "compile_s": r.compile_s,
           "collective_mib_measured": measured[name] / 2**20,
           "collective_mib_analytic": None if r.analytic_bytes is None else r.analytic_bytes / 2**20}
          for name, r in runners.items()]
  table = ["| strategy | step time / plain data 8 | / meshtrain dp | compile s "
           "| collectives MiB measured | analytic |", "|---|---|---|---|---|---|"]
  def mib(value):
    return "—" if value is None else f"{value:.1f}"

  table += [f"| {r['strategy']} | {r['step_time_ratio']:.2f} | {r['step_time_ratio_to_dp']:.2f} | "
            f"{r['compile_s']:.1f} | "
            f"{mib(r['collective_mib_measured'])} | {mib(r['collective_mib_analytic'])} |"
            for r in rows]
  write_section("strategies", rows, "\n".join(table),
                command=f"python bench/strategies.py --steps {args.steps} --rounds {args.rounds}")
  print("\n".join(table))


if __name__ == "__main__":
  main()
