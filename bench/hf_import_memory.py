"""Host memory of `import-hf` for a Llama 3.2 1B-shaped model on 8 simulated devices (fsdp=8).

  python bench/hf_import_memory.py [--dir /tmp/llama1b_hf]

Writes a random Llama 3.2 1B-shaped checkpoint (bfloat16, llama3 RoPE scaling)
as Hugging Face safetensors, and the same with its projections in fine-grained
float8 (e4m3 values, one float32 scale per 128 x 128 block, as DeepSeek-V3
publishes), then, for each, in a fresh process, places its weights on 8
simulated CPU devices with fsdp=8 (`meshtrain.hf.load.load_params`). Simulated
devices keep their arrays in host memory, so the import's overhead is its peak
resident memory (VmHWM) minus the resident memory before the import started
minus the bytes of the arrays placed; the issue's bound is 1.5x the largest
single tensor (the embedding). The optimizer state `import-hf` also creates is
computed on the devices and is not part of the host's overhead.
"""

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MIB = 2**20
LLAMA_3_2_1B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128_256,
    "hidden_size": 2048, "num_hidden_layers": 16, "num_attention_heads": 32,
    "num_key_value_heads": 8, "head_dim": 64, "intermediate_size": 8192, "rms_norm_eps": 1e-5,
    "rope_theta": 500_000.0, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    "hidden_act": "silu", "max_position_embeddings": 131_072,
    "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}


BLOCK = 128  # float8 scale blocks, rows and columns
E4M3_MAX = 448.0


def _float8_blocks(weight):
  """(e4m3 values, float32 scale per block) of a matrix whose sides BLOCK divides."""
  import ml_dtypes
  import numpy as np
  rows, cols = weight.shape
  blocks = weight.astype(np.float32).reshape(rows // BLOCK, BLOCK, cols // BLOCK, BLOCK)
  scale = np.abs(blocks).max(axis=(1, 3)) / E4M3_MAX
  values = (blocks / scale[:, None, :, None]).reshape(rows, cols)
  return values.astype(ml_dtypes.float8_e4m3fn), scale


def write_checkpoint(directory: Path, float8: bool) -> None:
  """Random bfloat16 weights in one model.safetensors, as the 3.2 1B release
  has them; with `float8`, its projections quantized."""
  import ml_dtypes
  import numpy as np
  import safetensors.numpy
  c = LLAMA_3_2_1B
  d, f, h = c["hidden_size"], c["intermediate_size"], c["head_dim"]
  n, k = c["num_attention_heads"], c["num_key_value_heads"]
  shapes = {"model.embed_tokens.weight": (c["vocab_size"], d), "model.norm.weight": (d,)}
  for i in range(c["num_hidden_layers"]):
    layer = f"model.layers.{i}."
    shapes.update({
        layer + "self_attn.q_proj.weight": (n * h, d),
        layer + "self_attn.k_proj.weight": (k * h, d),
        layer + "self_attn.v_proj.weight": (k * h, d),
        layer + "self_attn.o_proj.weight": (d, n * h),
        layer + "mlp.gate_proj.weight": (f, d), layer + "mlp.up_proj.weight": (f, d),
        layer + "mlp.down_proj.weight": (d, f), layer + "input_layernorm.weight": (d,),
        layer + "post_attention_layernorm.weight": (d,)})
  rng = np.random.default_rng(0)
  tensors = {name: (rng.standard_normal(shape, np.float32) * 0.02).astype(ml_dtypes.bfloat16)
             for name, shape in shapes.items()}
  if float8:
    for name in [name for name in tensors if "_proj." in name]:
      tensors[name], tensors[name + "_scale_inv"] = _float8_blocks(tensors[name])
    c = {**c, "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme":
                                      "dynamic", "weight_block_size": [BLOCK, BLOCK]}}
  directory.mkdir(parents=True, exist_ok=True)
  safetensors.numpy.save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
  (directory / "config.json").write_text(json.dumps(c, indent=2))


def _kib(field: str) -> int:
  for line in Path("/proc/self/status").read_text().splitlines():
    if line.startswith(field + ":"):
      return int(line.split()[1]) * 1024
  raise KeyError(field)


def measure(directory: str) -> dict:
  """In this (fresh) process: the import's peak host memory beyond what it places."""
  import time
  import jax
  from meshtrain.config import get_config
  from meshtrain.hf import config as hf_config
  from meshtrain.hf.load import load_params
  from meshtrain.train.setup import build
  cfg = get_config()
  cfg.model.update(hf_config.model_keys(hf_config.read(directory, key="--dir")))
  cfg.mesh.data, cfg.mesh.fsdp, cfg.global_batch = 1, 8, 8
  setup = build(cfg)
  before = _kib("VmRSS")
  start = time.perf_counter()
  params = jax.block_until_ready(load_params(directory, setup.spec.abstract_params,
                                             setup.shardings.params, key="--dir"))
  seconds = time.perf_counter() - start
  placed = sum(x.nbytes for x in jax.tree.leaves(params))
  peak = _kib("VmHWM")
  embedding = LLAMA_3_2_1B["vocab_size"] * LLAMA_3_2_1B["hidden_size"] * 2
  overhead = peak - before - placed
  return {"devices": jax.device_count(), "mesh": "fsdp=8", "placed_mib": placed / MIB,
          "rss_before_mib": before / MIB, "peak_rss_mib": peak / MIB,
          "overhead_mib": overhead / MIB, "largest_tensor_mib": embedding / MIB,
          "overhead_over_largest_tensor": overhead / embedding, "seconds": seconds}


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument("--dir", default="/tmp/llama1b_hf")
  parser.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.measure:
    print(json.dumps(measure(args.dir)))
    return
  env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
         "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO)}
  rows = []
  for float8, name in ((False, "bf16"), (True, "float8 projections (128 x 128 blocks)")):
    directory = Path(args.dir) / ("float8" if float8 else "bf16")
    if not (directory / "model.safetensors").is_file():
      write_checkpoint(directory, float8)
    result = subprocess.run([sys.executable, __file__, "--measure", "--dir", str(directory)],
                            env=env, capture_output=True, text=True, check=True)
    rows.append({"checkpoint": name, **json.loads(result.stdout.strip().splitlines()[-1])})
    print(json.dumps(rows[-1], indent=2))
  sys.path.insert(0, str(REPO / "bench"))
  os.environ["XLA_FLAGS"] = env["XLA_FLAGS"]
  from report import write_section
  table = ("| model | mesh | placed MiB | import overhead MiB | largest tensor MiB "
           "| overhead / largest | seconds |\n|---|---|---|---|---|---|---|\n" + "\n".join(
               f"| Llama 3.2 1B shape, {row['checkpoint']} safetensors | {row['mesh']} on "
               f"{row['devices']} cpu devices | {row['placed_mib']:.0f} | "
               f"{row['overhead_mib']:.0f} | {row['largest_tensor_mib']:.0f} | "
               f"{row['overhead_over_largest_tensor']:.2f} | {row['seconds']:.0f} |"
               for row in rows))
  write_section("hf_import_memory", rows, table, "python bench/hf_import_memory.py")


if __name__ == "__main__":
  main()
