"""Mixture-of-Experts: the step against a dense model of the same active
parameters and against a plain loop over experts; loss and balance on
shakespeare BPE.

  python bench/moe.py speed [--steps 4] [--rounds 3]
  python bench/moe.py pipeline [--steps 4] [--rounds 3]
  python bench/moe.py tensor [--steps 4] [--rounds 3]
  python bench/moe.py quality [--steps 600] [--seeds 3]

speed: on 8 simulated CPU devices, the tiny model (4 layers, width 128,
global batch 16 x 128 tokens) as a dense SwiGLU (hidden 384) and as 8
experts top-2 of hidden 192 each (the same active MLP parameters), both under
meshtrain on `fsdp=8` (the experts split over `fsdp`: two all-to-alls per MoE
layer forward), the MoE also with every expert on every device
(`expert_parallel=""`), and two plain-JAX baselines with the batch split over
8 devices and the weights replicated: the dense model, and the MoE whose
experts are a plain loop (every expert on every token, weighted by the
router). They take turns as in bench/strategies.py; a time is the median
step. Writes bench/results/moe_speed.json and its table in docs/moe.md.

pipeline: the dense model and the MoE on `pipeline=2 x fsdp=4` (1F1B, 4
microbatches), the experts over `fsdp` in each stage, on every device, and
with capacity 1.25. Writes bench/results/moe_pipeline.json and its table.

tensor: the dense model and the MoE (dropless and capacity 1.25) on
`tensor=2 x fsdp=4`, plain Megatron and with sequence parallelism, each tensor
device dispatching its share of the tokens. Writes
bench/results/moe_tensor.json and its table.

quality: the same dense model and 8 experts top-2 trained `steps` steps on
shakespeare with a 1024-id BPE (`meshtrain prepare`, into a temporary
directory), on `fsdp=8`, each with `seeds` seeds (a seed draws the
parameters and the data order; a dense run and an MoE run of one seed read
the same batches, so their difference is paired): without balancing, with
the switch loss (coef 0.1) and with DeepSeek-V3's bias (rate 1e-2, no switch
loss: its 1e-3 is for runs of thousands of steps). The experts take at most
1.25 x their share of a sequence's tokens (`capacity_factor` 1.25, as Switch
and GShard train; the dropped fraction is in the table). Evaluates every 25
steps on the held-out split; draws docs/moe.png (mean eval loss over the
seeds, busiest expert over the mean) and writes bench/results/moe_quality.json
and its table.
"""

import argparse
import os
import sys
import tempfile
from pathlib import Path

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import matplotlib  # noqa: E402
import numpy as np  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from meshtrain.config import get_config  # noqa: E402
from meshtrain.data.prepare import prepare  # noqa: E402
from meshtrain.models.flops import active_params, total_params  # noqa: E402
from meshtrain.models.llama import Slots  # noqa: E402
from meshtrain.train.loop import train  # noqa: E402
from meshtrain.train.parallelize import llama_spec, model_config  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
from report import write_section  # noqa: E402
from strategies import PlainRunner, Runner, time_in_turns  # noqa: E402

SHAKESPEARE = REPO.parent / "shared" / "data" / "tinyshakespeare.txt"
DOC = REPO / "docs" / "moe.md"
EXPERTS = dict(num_experts=8, experts_per_token=2, mlp_dim=192)  # active = the dense 384
BALANCING = {
    "8 experts top-2, no balancing": dict(aux_loss_coef=0.0),
    "8 experts top-2, switch loss 0.1": dict(aux_loss_coef=0.1),
    "8 experts top-2, bias 1e-2": dict(aux_loss_coef=0.0, bias_update_rate=1e-2),
}
QUALITY_CAPACITY = 1.25


def config(moe: dict | None = None, mesh: dict | None = None, **changes):
  cfg = get_config()
  cfg.update(global_batch=16, seq_len=128, **changes)
  cfg.mesh.update(mesh or dict(data=1, fsdp=8))
  cfg.checkpoint.every_steps = 0
  if moe is not None:
    cfg.model.moe.update(EXPERTS | moe)
  return cfg


def loop_over_experts(x_BxLxD, expert_BxLxK, weight_BxLxK, w_gate_ExDxF, w_up_ExDxF,
                      w_down_ExFxD, *, gemm: str = ""):
  """The experts slot written plainly: every expert on every token, weighted
  by what the router gave it (zero where it did not choose it); no grouped
  GEMM, so `gemm` changes nothing."""
  y_BxLxD = jnp.zeros(x_BxLxD.shape, jnp.float32)
  for e in range(w_gate_ExDxF.shape[0]):
    h = jax.nn.silu(x_BxLxD @ w_gate_ExDxF[e]) * (x_BxLxD @ w_up_ExDxF[e])
    weight_BxL = jnp.sum(jnp.where(expert_BxLxK == e, weight_BxLxK, 0.0), axis=-1)
    y_BxLxD = y_BxLxD + weight_BxL[..., None] * (h @ w_down_ExFxD[e])
  return y_BxLxD.astype(x_BxLxD.dtype)


def speed(steps: int, rounds: int):
  dense, moe = config(), config(moe={})
  loop_spec = llama_spec(model_config(moe), Slots(experts=loop_over_experts), moe.seed)
  runners = {
      "meshtrain dense, fsdp 8": Runner(dense),
      "meshtrain MoE, fsdp 8, experts over fsdp": Runner(moe),
      "meshtrain MoE, fsdp 8, every expert everywhere": Runner(config(moe={},
                                                                    expert_parallel="")),
      "meshtrain MoE, fsdp 8, experts over fsdp, capacity 1.25": Runner(
          config(moe=dict(capacity_factor=1.25))),
      "plain jax dense, batch over 8": PlainRunner(jax.devices(), dense),
      "plain jax loop over experts, batch over 8": PlainRunner(jax.devices(), moe, loop_spec),
  }
  report("moe_speed", runners, steps, rounds, {
      "meshtrain dense": "meshtrain dense, fsdp 8",
      "plain loop over experts": "plain jax loop over experts, batch over 8"})


def pipeline(steps: int, rounds: int):
  """The same models on `pipeline=2 x fsdp=4` (1F1B, 4 microbatches): the
  experts split over `fsdp` inside each stage, and every expert on every
  device."""
  stages = dict(mesh=dict(data=1, pipeline=2, fsdp=4))
  runners = {
      "meshtrain dense, pipeline 2 x fsdp 4": Runner(config(**stages)),
      "meshtrain MoE, experts over fsdp": Runner(config(moe={}, **stages)),
      "meshtrain MoE, every expert everywhere": Runner(config(moe={}, expert_parallel="",
                                                              **stages)),
      "meshtrain MoE, experts over fsdp, capacity 1.25": Runner(
          config(moe=dict(capacity_factor=1.25), **stages)),
  }
  report("moe_pipeline", runners, steps, rounds,
         {"meshtrain dense": "meshtrain dense, pipeline 2 x fsdp 4"})


def tensor(steps: int, rounds: int):
  """The same models on `tensor=2 x fsdp=4`, with and without Megatron-SP:
  each tensor device dispatches its share of the tokens."""
  meshes = {"tensor 2 x fsdp 4": dict(mesh=dict(data=1, fsdp=4, tensor=2)),
            "tensor 2 x fsdp 4, Megatron-SP": dict(mesh=dict(data=1, fsdp=4, tensor=2),
                                                   tensor_sequence_parallel=True)}
  runners = {}
  for name, mesh in meshes.items():
    runners[f"meshtrain dense, {name}"] = Runner(config(**mesh))
    runners[f"meshtrain MoE, {name}"] = Runner(config(moe={}, **mesh))
    runners[f"meshtrain MoE, {name}, capacity 1.25"] = Runner(
        config(moe=dict(capacity_factor=1.25), **mesh))
  report("moe_tensor", runners, steps, rounds,
         {f"dense, {name}": f"meshtrain dense, {name}" for name in meshes})


def report(section: str, runners: dict, steps: int, rounds: int, against: dict[str, str]):
  """Times the runners in turns; writes the section of docs/moe.md with each
  one's median step over each run `against` names (column title: run)."""
  measured = time_in_turns(runners, steps, rounds)
  median = {name: float(np.median(r.times)) for name, r in runners.items()}
  key = lambda title: "over_" + title.replace(" ", "_")  # noqa: E731
  rows = [{"run": name, "step_s": median[name],
           **{key(title): median[name] / median[run] for title, run in against.items()},
           "collective_mib": measured[name] / 2**20, "compile_s": r.compile_s}
          for name, r in runners.items()]
  table = ["| run | " + " | ".join(f"step / {title}" for title in against)
           + " | collectives MiB per device (profiled step) | compile s |",
           "|---|" + "---|" * (len(against) + 2)]
  table += [f"| {r['run']} | " + " | ".join(f"{r[key(t)]:.2f}" for t in against)
            + f" | {r['collective_mib']:.1f} | {r['compile_s']:.1f} |" for r in rows]
  part = section.removeprefix("moe_")
  write_section(section, rows, "\n".join(table), doc=DOC,
                command=f"python bench/moe.py {part} --steps {steps} --rounds {rounds}")
  print("\n".join(table))


def quality(steps: int, seeds: int):
  runs = {"dense (hidden 384)": None, **BALANCING}
  results = []
  with tempfile.TemporaryDirectory() as tmp:
    prepare([str(SHAKESPEARE)], "train:1024", f"{tmp}/corpus")
    for name, moe in runs.items():
      for seed in range(seeds):
        print(f"training {name}, seed {seed}", flush=True)
        moe_cfg = None if moe is None else moe | dict(capacity_factor=QUALITY_CAPACITY)
        cfg = config(moe=moe_cfg, steps=steps, seed=seed,
                     workdir=f"{tmp}/{len(results)}", log_every=1)
        cfg.model.vocab_size = 1024
        cfg.data.update(source="tokens", path=f"{tmp}/corpus")
        cfg.eval.update(every_steps=25, batches=8)
        records = train(cfg)
        spec = llama_spec(model_config(cfg))
        results.append({
            "run": name, "seed": seed,
            "active_params": active_params(model_config(cfg), spec.abstract_params),
            "total_params": total_params(spec.abstract_params),
            "steps": [r["step"] for r in records], "loss": [r["loss"] for r in records],
            "eval_steps": [r["step"] for r in records if "eval_loss" in r],
            "eval_loss": [r["eval_loss"] for r in records if "eval_loss" in r],
            "load_max_over_mean": [r.get("moe_load_max_over_mean") for r in records],
            "dropped_fraction": [r.get("moe_dropped_fraction") for r in records]})
  draw(results, REPO / "docs" / "moe.png")
  table = quality_table(results)
  write_section("moe_quality", results, f"{steps} steps of 16 x 128 tokens, {seeds} seeds, eval "
                "on 8 held-out batches.\n\n" + table, doc=DOC,
                command=f"python bench/moe.py quality --steps {steps} --seeds {seeds}")
  print(table)


def by_run(results: list[dict]) -> dict[str, list[dict]]:
  """The runs' names in order, each with its seeds' results."""
  runs: dict[str, list[dict]] = {}
  for r in results:
    runs.setdefault(r["run"], []).append(r)
  return runs


def quality_table(results: list[dict]) -> str:
  """Each run's final eval loss (mean and range over seeds), its difference
  from the dense run of the same seed, balance and dropped tokens (means of
  the last 20 steps over the seeds)."""
  runs = by_run(results)
  dense = {r["seed"]: r["eval_loss"][-1] for r in next(iter(runs.values()))}
  rows = ["| run | parameters (active / total) | eval loss, mean (min-max) | minus dense, "
          "same seed: mean (each seed) | busiest expert / mean | dropped |",
          "|---|---|---|---|---|---|"]
  for name, seeds in runs.items():
    final = np.array([r["eval_loss"][-1] for r in seeds])
    params = f"{seeds[0]['active_params'] / 1e6:.2f}M / {seeds[0]['total_params'] / 1e6:.2f}M"
    cells = [name, params,
             f"{final.mean():.4f} ({final.min():.4f}-{final.max():.4f})", "—", "—", "—"]
    if seeds[0]["load_max_over_mean"][0] is not None:
      diff = [r["eval_loss"][-1] - dense[r["seed"]] for r in seeds]
      cells[3] = f"{np.mean(diff):+.4f} ({', '.join(f'{d:+.3f}' for d in diff)})"
      cells[4] = f"{np.mean([v for r in seeds for v in r['load_max_over_mean'][-20:]]):.2f}"
      cells[5] = f"{np.mean([v for r in seeds for v in r['dropped_fraction'][-20:]]):.1%}"
    rows.append("| " + " | ".join(cells) + " |")
  return "\n".join(rows)


def draw(results: list[dict], path: Path):
  fig, (loss_ax, load_ax) = plt.subplots(1, 2, figsize=(11, 4))
  colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
  for (name, seeds), color in zip(by_run(results).items(), colors):
    loss_ax.plot(seeds[0]["eval_steps"], np.mean([r["eval_loss"] for r in seeds], axis=0),
                 marker="o", markersize=3, label=name, color=color)
    if seeds[0]["load_max_over_mean"][0] is not None:
      load_ax.plot(seeds[0]["steps"], np.mean([r["load_max_over_mean"] for r in seeds], axis=0),
                   label=name, linewidth=1, color=color)
  loss_ax.set_xlabel("step")
  loss_ax.set_ylabel("eval loss (held-out shakespeare), mean over seeds")
  loss_ax.set_title("same active parameters")
  loss_ax.legend(fontsize=8)
  load_ax.axhline(1.5, color="grey", linestyle="--", linewidth=1)
  load_ax.set_xlabel("step")
  load_ax.set_ylabel("busiest expert / mean load (worst layer)")
  load_ax.set_title("balance")
  load_ax.legend(fontsize=8)
  fig.suptitle("tiny Llama on shakespeare (1024-id BPE), 8 simulated devices (fsdp=8)")
  fig.tight_layout()
  fig.savefig(path, dpi=110)


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("part", choices=("speed", "pipeline", "tensor", "quality"))
  parser.add_argument("--steps", type=int, default=None)
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--seeds", type=int, default=3)
  args = parser.parse_args()
  timed = {"speed": speed, "pipeline": pipeline, "tensor": tensor}
  if args.part in timed:
    timed[args.part](args.steps or 4, args.rounds)
  else:
    quality(args.steps or 600, args.seeds)


if __name__ == "__main__":
  main()
