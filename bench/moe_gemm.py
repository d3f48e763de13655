"""The routed experts' SwiGLU, forward and backward, on one device: each
grouped GEMM of `model.moe.grouped_gemm` against a dense SwiGLU doing the
same FLOPs, and what XLA compiled each into.

  python bench/moe_gemm.py                       # the 1B MoE setting of bench/gpu.py
  python bench/moe_gemm.py --tokens 512 --dim 64 --hidden 64 --steps 3   # a smoke run

Tokens are routed uniformly at random (k distinct experts each). A time is the
mean of `--steps` calls after one warm-up, with one host sync at the end.
"Useful TFLOP/s" counts the FLOPs of the rows each expert really has (6 GEMMs of
2 x rows x dim x hidden), so a GEMM that computes every expert on every row,
or pads, shows as a low rate. For each, the optimized program's op counts:
dots, ragged dots and custom calls by target (cuBLAS, cuDNN). Prints a
markdown table; with `--out DIR`, also the rows as JSON and each optimized
program as text there.
"""

import argparse
import collections
import json
import re
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from meshtrain.parallel import experts  # noqa: E402


def swiglu_loss(gemm: str):
  """sum(y * cotangent) of the experts on x; `dense` is one SwiGLU of hidden k x F."""
  def loss(x_TxD, expert_TxK, weight_TxK, w_gate, w_up, w_down, cotangent_TxD):
    if gemm == "dense":
      h = jax.nn.silu(x_TxD @ w_gate) * (x_TxD @ w_up)
      y = h @ w_down
    else:
      y = experts.grouped_experts(x_TxD[None], expert_TxK[None], weight_TxK[None], w_gate, w_up,
                                  w_down, gemm=gemm)[0]
    return jnp.sum(y.astype(jnp.float32) * cotangent_TxD)
  return jax.jit(jax.value_and_grad(loss, argnums=(0, 3, 4, 5)))


def compiled_ops(compiled) -> dict:
  """Op counts of the optimized program: dots, ragged dots, custom calls by target."""
  text = compiled.as_text()
  return {"dots": len(re.findall(r" dot\(", text)),
          "ragged_dots": len(re.findall(r" ragged-dot\(", text)),
          "custom_calls": dict(collections.Counter(
              re.findall(r'custom_call_target="([^"]+)"', text)))}


def run(gemm: str, tokens: int, dim: int, hidden: int, num_experts: int, k: int, steps: int,
        dtype, hlo_dir: str | None = None) -> dict:
  rng = np.random.default_rng(0)
  keys = jax.random.split(jax.random.key(0), 6)
  x = jax.random.normal(keys[0], (tokens, dim), dtype)
  cotangent = jax.random.normal(keys[1], (tokens, dim), jnp.float32)
  expert = jnp.asarray(np.argsort(rng.random((tokens, num_experts)), axis=1)[:, :k], jnp.int32)
  weight = jnp.full((tokens, k), 1.0 / k, jnp.float32)
  if gemm == "dense":
    shapes = [(dim, k * hidden), (dim, k * hidden), (k * hidden, dim)]
  else:
    shapes = [(num_experts, dim, hidden), (num_experts, dim, hidden), (num_experts, hidden, dim)]
  w = [jax.random.normal(key, shape, dtype) * shape[-2] ** -0.5
       for key, shape in zip(keys[2:], shapes)]
  fn = swiglu_loss(gemm)
  args = (x, expert, weight, *w, cotangent)
  compiled = fn.lower(*args).compile()
  jax.block_until_ready(compiled(*args))
  start = time.perf_counter()
  for _ in range(steps):
    out = compiled(*args)
  jax.block_until_ready(out)
  step_s = (time.perf_counter() - start) / steps
  useful = 9 * 2 * tokens * k * dim * hidden  # three GEMMs forward, six backward
  if hlo_dir:
    Path(hlo_dir, f"moe_gemm_{gemm}_{experts.MAX_TILE}.hlo.txt").write_text(compiled.as_text())
  return {"gemm": gemm, "tokens": tokens, "dim": dim, "hidden": hidden, "experts": num_experts,
          "k": k, "dtype": jnp.dtype(dtype).name, "device": jax.devices()[0].device_kind,
          "jax": jax.__version__, "ms": step_s * 1e3, "useful_tflops": useful / step_s / 1e12,
          **compiled_ops(compiled)}


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--tokens", type=int, default=16384, help="tokens on the device (batch x length)")
  parser.add_argument("--dim", type=int, default=2048)
  parser.add_argument("--hidden", type=int, default=2048, help="each expert's hidden width")
  parser.add_argument("--experts", type=int, default=8)
  parser.add_argument("--k", type=int, default=2)
  parser.add_argument("--steps", type=int, default=10)
  parser.add_argument("--dtype", default="bfloat16")
  parser.add_argument("--gemms", default=",".join(("dense", *experts.GEMMS)))
  parser.add_argument("--tiles", default=str(experts.MAX_TILE),
                      help="comma-separated largest tiles (rows) to try for `tiled`")
  parser.add_argument("--out", help="a folder for moe_gemm.json and the optimized programs")
  args = parser.parse_args()
  rows = []
  for gemm in args.gemms.split(","):
    for tile in args.tiles.split(",") if gemm == "tiled" else [experts.MAX_TILE]:
      experts.MAX_TILE = int(tile)
      rows.append(run(gemm, args.tokens, args.dim, args.hidden, args.experts, args.k, args.steps,
                      jnp.dtype(args.dtype), args.out))
      rows[-1]["tile"] = experts.tile_rows(args.tokens * args.k, args.experts)
  print(f"{rows[0]['device']}, jax {rows[0]['jax']}: {args.tokens} tokens x {args.dim}, "
        f"{args.experts} experts of hidden {args.hidden}, top-{args.k}, {args.dtype}")
  print("| GEMM | tile rows | ms fwd+bwd | useful TFLOP/s | dots | ragged dots | custom calls |\n"
        "|---|---|---|---|---|---|---|")
  for row in rows:
    calls = ", ".join(f"{t} {n}" for t, n in sorted(row["custom_calls"].items())) or "none"
    tile = row["tile"] if row["gemm"] == "tiled" else "—"
    print(f"| {row['gemm']} | {tile} | {row['ms']:.2f} | {row['useful_tflops']:.2f} | {row['dots']} | "
          f"{row['ragged_dots']} | {calls} |")
  if args.out:
    Path(args.out, "moe_gemm.json").write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
  main()
