"""The routed experts' SwiGLU, forward and backward, on one device: each
grouped GEMM of `experts.grouped_gemm` against a dense SwiGLU doing the
same FLOPs, and what XLA compiled each into.

  python bench/moe_gemm.py                       # the 1B MoE setting of bench/gpu.py
  python bench/moe_gemm.py --tokens 512 --dim 64 --hidden 64 --steps 3   # a smoke run
  python bench/moe_gemm.py --gemms tiled,hopper --hopper-blocks 128x128x64x4,64x128x64x4  # H100/H200

Tokens are routed uniformly at random (k distinct experts each). A time is the
mean of `--steps` calls after one warm-up, with one host sync at the end.
"Useful TFLOP/s" counts the FLOPs of the rows each expert really has (6 GEMMs of
2 x rows x dim x hidden), so a GEMM that computes every expert on every row,
or pads, shows as a low rate. For each, the optimized program's op counts:
dots, ragged dots, scatters of floating-point values (a GPU scatter-adds
atomically; the routing's own are of integers) and custom calls by target
(cuBLAS, cuDNN), and the largest
difference of its loss and gradients from the first grouped GEMM's, relative
to that one's largest value (bfloat16 rounding is about 4e-3). Prints a
markdown table; with `--out DIR`, also the rows as JSON and each optimized
program as text there.
"""

import argparse
import collections
import functools
import json
import re
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from meshtrain.parallel import experts, hopper_gemm  # noqa: E402


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
  """Op counts of the optimized program: dots, ragged dots, floating-point
  scatters, custom calls by target."""
  text = compiled.as_text()
  return {"dots": len(re.findall(r" dot\(", text)),
          "ragged_dots": len(re.findall(r" ragged-dot\(", text)),
          "float_scatters": len(re.findall(r"= b?f\d+\[[^ ]* scatter\(", text)),
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
  row = {"gemm": gemm, "tokens": tokens, "dim": dim, "hidden": hidden, "experts": num_experts,
         "k": k, "dtype": jnp.dtype(dtype).name, "device": jax.devices()[0].device_kind,
         "jax": jax.__version__, "ms": step_s * 1e3, "useful_tflops": useful / step_s / 1e12,
         **compiled_ops(compiled)}
  return row, jax.tree.leaves(out)


def relative_difference(outputs, reference) -> float:
  """The largest |a - b| over the outputs, relative to each reference's largest |b|."""
  return max(float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))) /
                   jnp.max(jnp.abs(b.astype(jnp.float32)))) for a, b in zip(outputs, reference))


def variants(gemm: str, args):
  """(label, setup) of each variant of `gemm` the flags ask for: tile rows for
  `tiled`, tile shapes M x N x K x stages for `hopper`."""
  if gemm == "tiled":
    return [(tile, lambda tile=tile: setattr(experts, "MAX_TILE", int(tile)))
            for tile in args.tiles.split(",")]
  if gemm == "hopper":
    def shape(blocks):
      m, n, k, stages = map(int, blocks.split("x"))
      hopper_gemm.BLOCK_M, hopper_gemm.BLOCK_N, hopper_gemm.BLOCK_K, hopper_gemm.STAGES = (
          m, n, k, stages)
    return [(blocks, functools.partial(shape, blocks)) for blocks in args.hopper_blocks.split(",")]
  return [("—", lambda: None)]


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
  parser.add_argument("--hopper-blocks", default="x".join(map(str, (
      hopper_gemm.BLOCK_M, hopper_gemm.BLOCK_N, hopper_gemm.BLOCK_K, hopper_gemm.STAGES))),
      help="comma-separated tile shapes MxNxKxSTAGES to try for `hopper`")
  parser.add_argument("--out", help="a folder for moe_gemm.json and the optimized programs")
  args = parser.parse_args()
  rows, reference = [], None
  for gemm in args.gemms.split(","):
    for label, setup in variants(gemm, args):
      setup()
      try:
        row, outputs = run(gemm, args.tokens, args.dim, args.hidden, args.experts, args.k,
                           args.steps, jnp.dtype(args.dtype), args.out)
      except Exception as error:  # a tile shape over the shared memory, say: a row saying so
        rows.append({"gemm": gemm, "variant": label, "error": f"{type(error).__name__}: "
                     f"{(str(error).strip().splitlines() or [''])[0][:200]}"})
        print(rows[-1], flush=True)
        continue
      if gemm != "dense":  # a dense SwiGLU has other weights: nothing to compare
        reference = reference or outputs
      row.update(variant=str(experts.tile_rows(args.tokens * args.k, args.experts))
                 if gemm == "tiled" else label,
                 difference=None if gemm == "dense" else relative_difference(outputs, reference))
      rows.append(row)
      print(row, flush=True)
  done = [row for row in rows if "error" not in row]
  print(f"{done[0]['device']}, jax {done[0]['jax']}: {args.tokens} tokens x {args.dim}, "
        f"{args.experts} experts of hidden {args.hidden}, top-{args.k}, {args.dtype}")
  print("| GEMM | tile | ms fwd+bwd | useful TFLOP/s | difference | dots | ragged dots | "
        "float scatters | custom calls |\n|---|---|---|---|---|---|---|---|---|")
  for row in rows:
    if "error" in row:
      print(f"| {row['gemm']} | {row['variant']} | failed: {row['error']} |")
      continue
    calls = ", ".join(f"{t} {n}" for t, n in sorted(row["custom_calls"].items())) or "none"
    difference = "—" if row["difference"] is None else f"{row['difference']:.1e}"
    print(f"| {row['gemm']} | {row['variant']} | {row['ms']:.2f} | {row['useful_tflops']:.2f} | "
          f"{difference} | {row['dots']} | {row['ragged_dots']} | "
          f"{row['float_scatters']} | {calls} |")
  if args.out:
    Path(args.out, "moe_gemm.json").write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
  main()
