"""Tokens/s and MFU of meshtrain's train step on one GPU, bfloat16, over a sweep of settings.

  python bench/gpu.py                                   # 1B preset, every setting below
  python bench/gpu.py --model llama_3b --batch 4 --settings selective-cudnn,full-cudnn
  python bench/gpu.py --model tiny --batch 2 --seq 128 --steps 2   # a smoke run (CPU works too)
  python bench/gpu.py --render a/gpu_llama_1b.json b/gpu_llama_1b.json   # table from JSON made elsewhere

Each setting runs in its own process, because XLA flags are read once at start,
under `--timeout` seconds: compile, `--warmup` steps, then `--steps` timed steps
(one host sync at the end, so the device queue never drains between them). A
setting that fails (out of memory, say) or times out becomes a row saying so.
MFU counts the model FLOPs of `meshtrain.models.flops` (6N + attention from
active parameters, recomputation not counted) against the device's dense bf16
peak; peak GiB is the device allocator's high-water mark. The rows go to
`--out`/gpu_MODEL.json after every setting (so an interrupted sweep keeps what
it measured). `--render` writes their table between the markers in
docs/benchmarks.md, stamped with device, jax version and date, with the
planner's prediction of each step beside it (the planner traces the model with
the jax meshtrain pins, so render where meshtrain is installed).

Needs what `meshtrain.train.setup` imports (jax, flax, optax, orbax, grain,
ml_collections); on a GPU image that lacks some, they can travel as wheels.
"""

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "bench")]  # runs from a checkout, installed or not

# Dense bf16 peak FLOP/s by device kind (NVIDIA data sheets, SXM parts).
PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "B200": 2250e12}
# The XLA flags MaxText and the JAX GPU performance guide recommend for one GPU.
FAST_XLA = ("--xla_gpu_enable_latency_hiding_scheduler=true "
            "--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUDNN,CUSTOM_CALL "
            "--xla_gpu_enable_highest_priority_async_stream=true")
SETTINGS = {  # id -> (config changes, XLA_FLAGS)
    "selective-cudnn": ({"remat": "selective", "attention.implementation": "cudnn"}, FAST_XLA),
    "selective-xla": ({"remat": "selective", "attention.implementation": "xla"}, FAST_XLA),
    "selective-cudnn-default-flags": ({"remat": "selective", "attention.implementation": "cudnn"},
                                      ""),
    "full-cudnn": ({"remat": "full", "attention.implementation": "cudnn"}, FAST_XLA),
    "none-cudnn": ({"remat": "none", "attention.implementation": "cudnn"}, FAST_XLA),
    # What each offload saves of the device's peak memory, and what it costs in time.
    "offload-params": ({"remat": "selective", "attention.implementation": "cudnn",
                        "offload.params": True}, FAST_XLA),
    "offload-optimizer": ({"remat": "selective", "attention.implementation": "cudnn",
                           "offload.optimizer": True}, FAST_XLA),
    "remat-offload": ({"remat": "offload", "attention.implementation": "cudnn"}, FAST_XLA),
    # The preset with 8 experts of a quarter of its MLP width, top 2, dropless: its MLP
    # does half the dense FLOPs, so MFU (from active parameters) compares the two.
    # Its grouped GEMM: `auto` (Hopper's kernels on an H100 or H200), then each other.
    **{f"moe-8x-top2{suffix}": ({"remat": "selective", "attention.implementation": "cudnn",
                                 "model.moe.num_experts": 8, "model.moe.experts_per_token": 2,
                                 "model.moe.mlp_dim": 2048, "experts.grouped_gemm": gemm},
                                FAST_XLA)
       for suffix, gemm in (("", "auto"), ("-tiled", "tiled"), ("-ragged-dot", "ragged_dot"))},
}


def peak_flops(device) -> float:
  return next((peak for kind, peak in PEAK_BF16.items() if kind in device.device_kind), 0.0)


def one_device_config(model: str, batch_size: int, seq_len: int, changes: dict):
  """The preset `model` on one device in bfloat16, with a setting's changes."""
  from meshtrain.config import load

  cfg = load(REPO / "configs" / f"{model}.py")
  cfg.update(global_batch=batch_size, seq_len=seq_len, param_dtype="bfloat16",
             compute_dtype="bfloat16")
  cfg.mesh.data = 1
  cfg.update_from_flattened_dict(changes)
  return cfg


def cluster_preset(device_kind: str) -> str | None:
  """The planner's cluster preset of a device (`h100` for "NVIDIA H100 80GB HBM3"), if any."""
  from meshtrain.planner import clusters

  return next((name for name in clusters.PRESETS if name.upper() in device_kind), None)


def predicted_step_s(row: dict) -> float | None:
  """The planner's step time for a measured row's configuration on its
  device's cluster (None where it models no such setting: offload, XLA's
  attention, `ragged_dot` experts, a device without a cluster)."""
  from meshtrain.mesh import AXES
  from meshtrain.planner import clusters, search

  changes = SETTINGS[row["setting"]][0]
  cluster = cluster_preset(row["device"])
  if (cluster is None or row["attention"] != "cudnn"
      or any(key.startswith("offload") for key in changes)
      or changes["remat"] not in search.REMATS
      or changes.get("experts.grouped_gemm") == "ragged_dot"):
    return None
  cfg = one_device_config(row["model"], row["batch"], row["seq_len"], changes)
  model = search.StepModel(cfg, clusters.load(cluster))
  candidate = search.Candidate(mesh=tuple((axis, 1) for axis in AXES), remat=changes["remat"])
  return model.estimate(candidate).step_s


def run_one(model: str, batch_size: int, seq_len: int, steps: int, warmup: int,
            changes: dict) -> dict:
  """Measures one setting in this process, on its first device."""
  import jax
  import numpy as np

  from meshtrain.models.flops import flops_per_token
  from meshtrain.train.parallelize import attention_kernel, grouped_gemm, model_config
  from meshtrain.train.setup import build

  cfg = one_device_config(model, batch_size, seq_len, changes)
  cfg.steps = warmup + steps + 1
  setup = build(cfg, jax.devices()[:1])
  state = setup.init_state()
  tokens = np.random.default_rng(0).integers(0, cfg.model.vocab_size, (batch_size, seq_len + 1),
                                             dtype=np.int32)
  batch = jax.device_put({"inputs": tokens[:, :-1], "targets": tokens[:, 1:]},
                         setup.train_step.batch_sharding)
  start = time.perf_counter()
  compiled = setup.train_step.lower(state, batch).compile()
  compile_s = time.perf_counter() - start
  memory = compiled.memory_analysis()
  for _ in range(warmup + 1):
    state, metrics = setup.train_step(state, batch)
  jax.block_until_ready(metrics)
  start = time.perf_counter()
  for _ in range(steps):
    state, metrics = setup.train_step(state, batch)
  jax.block_until_ready(metrics)
  step_s = (time.perf_counter() - start) / steps
  tokens_per_s = batch_size * seq_len / step_s
  device = jax.devices()[0]
  peak = peak_flops(device)
  peak_bytes = (device.memory_stats() or {}).get("peak_bytes_in_use")
  model_cfg = model_config(cfg)
  model_flops = flops_per_token(model_cfg, setup.spec.abstract_params, seq_len)
  return {"model": model, "batch": batch_size, "seq_len": seq_len, "steps": steps, **changes,
          "attention": attention_kernel(cfg),
          "gemm": grouped_gemm(cfg) if model_cfg.moe.num_experts else None,
          "xla_flags": os.environ.get("XLA_FLAGS", ""), "device": device.device_kind,
          "jax": jax.__version__, "date": time.strftime("%Y-%m-%d"),
          "step_s": step_s, "tokens_per_s": tokens_per_s, "flops_per_token": model_flops,
          "tflops_per_s": tokens_per_s * model_flops / 1e12,
          "mfu": tokens_per_s * model_flops / peak if peak else None,
          "compile_s": compile_s, "loss": float(metrics["loss"]),
          "peak_gib": peak_bytes / 2**30 if peak_bytes else None,
          "temp_gib": memory.temp_size_in_bytes / 2**30 if memory else None,
          "arguments_gib": memory.argument_size_in_bytes / 2**30 if memory else None}


def measure(args, setting: str) -> dict:
  """One setting in a subprocess with its XLA flags: its row, or the reason it has none."""
  changes, xla_flags = SETTINGS[setting]
  # jax takes 75% of GPU memory by default; the 3B preset needs more.
  env = {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.95", **os.environ,
         "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} {xla_flags}".strip()}
  command = [sys.executable, __file__, "--one", setting, "--model", args.model,
             "--batch", str(args.batch), "--seq", str(args.seq), "--steps", str(args.steps),
             "--warmup", str(args.warmup)]
  try:
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=args.timeout)
  except subprocess.TimeoutExpired:
    return {"setting": setting, "error": f"timed out after {args.timeout} s"}
  if result.returncode:
    print(result.stderr[-3000:], flush=True)
    lines = result.stderr.strip().splitlines()
    errors = [line for line in lines if re.match(r"[\w.]+(Error|Exception)\b", line)]
    return {"setting": setting,
            "error": (errors or lines or [f"exit code {result.returncode}"])[-1][:200]}
  return {"setting": setting, **json.loads(result.stdout.strip().splitlines()[-1])}


def table(rows: list[dict], planner: bool = True) -> str:
  """The rows as markdown; `planner` adds the planner's step time for each
  (it traces the model, so it needs the jax meshtrain pins)."""
  lines = ["| setting | attention, experts | tokens/s | TFLOP/s | MFU | step ms | planner ms | peak GiB | "
           "temp GiB | compile s |", "|---|---|---|---|---|---|---|---|---|---|"]
  for row in rows:
    if "error" in row:
      lines.append(f"| {row['setting']} | failed: {row['error']} | | | | | | | | |")
    else:
      peak = f"{row['peak_gib']:.1f}" if row.get("peak_gib") else "—"
      predicted = predicted_step_s(row) if planner else None
      predicted = f"{predicted * 1e3:.0f}" if predicted else "—"
      kernels = ", ".join(k for k in (row["attention"], row.get("gemm")) if k)
      lines.append(f"| {row['setting']} | {kernels} | {row['tokens_per_s']:,.0f} | "
                   f"{row['tflops_per_s']:.0f} | {(row['mfu'] or 0):.1%} | "
                   f"{row['step_s'] * 1e3:.0f} | {predicted} | {peak} | "
                   f"{row['temp_gib'] or 0:.1f} | {row['compile_s']:.0f} |")
  return "\n".join(lines)


def render(rows: list[dict]) -> None:
  """Writes the rows' table into docs/benchmarks.md (and their JSON into
  bench/results), stamped with the device, jax version and date they were
  measured with, wherever this runs."""
  from report import write_section

  first = next(row for row in rows if "error" not in row)
  settings = ",".join(row["setting"] for row in rows)
  device = cluster_preset(first["device"]) or re.sub(r"\W+", "_", first["device"].lower())
  write_section(
      f"gpu_{first['model']}_{device}", rows,
      f"{first['model']}, batch {first['batch']} x {first['seq_len']} tokens, bfloat16\n\n"
      f"{table(rows)}",
      command=f"python bench/gpu.py --model {first['model']} --batch {first['batch']} "
              f"--seq {first['seq_len']} --steps {first['steps']} --settings {settings}",
      measured_on=f"{' and '.join(sorted({row['date'] for row in rows if 'date' in row}))}, "
                  f"jax {first['jax']}, one {first['device']}")


def sweep(args) -> None:
  out = Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  rows = []
  for setting in args.settings.split(","):
    print(f"{setting} ...", flush=True)
    rows.append(measure(args, setting))
    (out / f"gpu_{args.model}.json").write_text(json.dumps(rows, indent=2) + "\n")
    row = rows[-1]
    print(f"  {row['error']}" if "error" in row else
          f"  {row['tokens_per_s']:,.0f} tokens/s, MFU {row['mfu'] or 0:.1%}", flush=True)
  print(table(rows, planner=False))


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--model", default="llama_1b", help="a model preset in configs/")
  parser.add_argument("--batch", type=int, default=8)
  parser.add_argument("--seq", type=int, default=2048)
  parser.add_argument("--steps", type=int, default=10)
  parser.add_argument("--warmup", type=int, default=2)
  parser.add_argument("--settings", default=",".join(SETTINGS),
                      help=f"comma-separated, of: {', '.join(SETTINGS)}")
  parser.add_argument("--timeout", type=int, default=300, help="seconds per setting")
  parser.add_argument("--out", default=str(REPO / "bench" / "results"),
                      help="folder for gpu_MODEL.json, written after every setting")
  parser.add_argument("--render", metavar="JSON", nargs="+",
                      help="write the docs table from gpu_MODEL.json files measured elsewhere")
  parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: one setting, JSON on stdout
  args = parser.parse_args()
  unknown = set(args.settings.split(",")) - set(SETTINGS)
  if unknown:
    parser.error(f"unknown settings {', '.join(sorted(unknown))}; choose from {', '.join(SETTINGS)}")
  if args.render:
    # Sweeps split over several runs: a later row of a setting replaces an earlier one.
    rows = {row["setting"]: row for path in args.render for row in json.loads(Path(path).read_text())}
    if all("error" in row for row in rows.values()):
      parser.error(f"{' '.join(args.render)} hold no measured setting")
    render(list(rows.values()))
  elif args.one:
    print(json.dumps(run_one(args.model, args.batch, args.seq, args.steps, args.warmup,
                             SETTINGS[args.one][0])))
  else:
    sweep(args)


if __name__ == "__main__":
  main()
