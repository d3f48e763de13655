"""Tokens/s and MFU of meshtrain's train step on one GPU, bfloat16, over a sweep of settings.

  python bench/gpu.py                       # 1B preset: the sweep below, one subprocess each
  python bench/gpu.py --model tiny --steps 3 --batch 4 --seq 128   # a smoke run (CPU works too)

Each setting runs in its own process because XLA flags are read once, at start:
compile, `--warmup` steps, then `--steps` timed steps (one host sync at the
end of each, so the device queue never drains between them). MFU counts the
model FLOPs of `meshtrain.analysis.flops` (6N + attention, recomputation not
counted) against the device's dense bf16 peak. Writes bench/results/gpu.json and
the table between the markers in docs/benchmarks.md, with device, jax version
and date.
"""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# Dense bf16 peak FLOP/s by device kind (NVIDIA data sheets, SXM parts).
PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "B200": 2250e12}
# The XLA flags MaxText and the JAX GPU performance guide recommend for one GPU.
FAST_XLA = ("--xla_gpu_enable_latency_hiding_scheduler=true "
            "--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUDNN,CUSTOM_CALL "
            "--xla_gpu_enable_highest_priority_async_stream=true")
SETTINGS = {  # name -> (config changes, XLA_FLAGS)
    "selective, cudnn, fast flags": ({"remat": "selective", "attention.implementation": "cudnn"},
                                     FAST_XLA),
    "selective, xla attention, fast flags": ({"remat": "selective",
                                              "attention.implementation": "xla"}, FAST_XLA),
    "selective, cudnn, default flags": ({"remat": "selective",
                                         "attention.implementation": "cudnn"}, ""),
    "full, cudnn, fast flags": ({"remat": "full", "attention.implementation": "cudnn"}, FAST_XLA),
    "none, cudnn, fast flags": ({"remat": "none", "attention.implementation": "cudnn"}, FAST_XLA),
}


def peak_flops(device) -> float:
  return next((peak for kind, peak in PEAK_BF16.items() if kind in device.device_kind), 0.0)


def run_one(args, changes: dict) -> dict:
  """Measures one setting in this process."""
  import jax
  import numpy as np

  from meshtrain.analysis.flops import flops_per_token
  from meshtrain.config import load
  from meshtrain.train.loop import to_global
  from meshtrain.train.setup import build
  from meshtrain.train.state import model_config

  cfg = load(REPO / "configs" / f"{args.model}.py")
  cfg.update(global_batch=args.batch, seq_len=args.seq, param_dtype="bfloat16",
             compute_dtype="bfloat16", steps=args.warmup + args.steps + 1)
  cfg.mesh.data = 1
  for key, value in changes.items():
    section, _, name = key.rpartition(".")
    (cfg[section] if section else cfg)[name] = value
  setup = build(cfg, jax.devices()[:1])
  state = setup.init_state()
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, cfg.model.vocab_size, (args.batch, args.seq + 1), dtype=np.int32)
  batch = to_global({"inputs": tokens[:, :-1], "targets": tokens[:, 1:]},
                    setup.train_step.batch_sharding)
  start = time.perf_counter()
  compiled = setup.train_step.lower(state, batch).compile()
  compile_s = time.perf_counter() - start
  memory = compiled.memory_analysis()
  for _ in range(args.warmup + 1):
    state, metrics = setup.train_step(state, batch)
  jax.block_until_ready(metrics)
  start = time.perf_counter()
  for _ in range(args.steps):
    state, metrics = setup.train_step(state, batch)
  jax.block_until_ready(metrics)
  step_s = (time.perf_counter() - start) / args.steps
  tokens_per_s = args.batch * args.seq / step_s
  device = jax.devices()[0]
  peak = peak_flops(device)
  model_flops = flops_per_token(model_config(cfg), setup.spec.abstract_params, args.seq)
  return {"model": args.model, "batch": args.batch, "seq_len": args.seq, **changes,
          "xla_flags": os.environ.get("XLA_FLAGS", ""), "device": device.device_kind,
          "jax": jax.__version__, "date": time.strftime("%Y-%m-%d"),
          "step_s": step_s, "tokens_per_s": tokens_per_s,
          "tflops_per_s": tokens_per_s * model_flops / 1e12,
          "mfu": tokens_per_s * model_flops / peak if peak else None,
          "compile_s": compile_s, "loss": float(metrics["loss"]),
          "temp_gib": memory.temp_size_in_bytes / 2**30 if memory else None}


def sweep(args) -> None:
  sys.path.insert(0, str(REPO / "bench"))
  from report import write_section

  rows = []
  for name, (changes, xla_flags) in SETTINGS.items():
    print(f"{name} ...", flush=True)
    env = {**os.environ, "XLA_FLAGS": xla_flags}
    result = subprocess.run(
        [sys.executable, __file__, "--one", json.dumps(changes), "--model", args.model,
         "--batch", str(args.batch), "--seq", str(args.seq), "--steps", str(args.steps),
         "--warmup", str(args.warmup)], env=env, capture_output=True, text=True)
    if result.returncode:
      print(result.stderr[-2000:], flush=True)
      rows.append({"setting": name, "error": result.stderr.strip().splitlines()[-1][:200]})
      continue
    rows.append({"setting": name, **json.loads(result.stdout.strip().splitlines()[-1])})
    print(f"  {rows[-1]['tokens_per_s']:,.0f} tokens/s, MFU {rows[-1]['mfu'] or 0:.1%}", flush=True)
  table = ["| setting | tokens/s | TFLOP/s | MFU | temp GiB | compile s |", "|---|---|---|---|---|---|"]
  for row in rows:
    if "error" in row:
      table.append(f"| {row['setting']} | failed: {row['error']} | | | | |")
    else:
      table.append(f"| {row['setting']} | {row['tokens_per_s']:,.0f} | {row['tflops_per_s']:.0f} | "
                   f"{(row['mfu'] or 0):.1%} | {row['temp_gib'] or 0:.1f} | {row['compile_s']:.0f} |")
  ok = [row for row in rows if "error" not in row]
  device = ok[0]["device"] if ok else "?"
  write_section(f"gpu_{args.model}", rows, f"{args.model}, batch {args.batch} x {args.seq} "
                f"tokens, bfloat16, one {device}\n\n" + "\n".join(table),
                command=f"python bench/gpu.py --model {args.model} --batch {args.batch} "
                        f"--seq {args.seq} --steps {args.steps}")
  print("\n".join(table))


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--model", default="llama_1b", help="a model preset in configs/")
  parser.add_argument("--batch", type=int, default=8)
  parser.add_argument("--seq", type=int, default=2048)
  parser.add_argument("--steps", type=int, default=10)
  parser.add_argument("--warmup", type=int, default=2)
  parser.add_argument("--one", help="internal: measure one setting (JSON changes) and print JSON")
  args = parser.parse_args()
  if args.one is None:
    sweep(args)
  else:
    print(json.dumps(run_one(args, json.loads(args.one))))


if __name__ == "__main__":
  main()
