"""What one Llama layer keeps for its backward, per remat policy, in units of
sbh (sequence x batch x hidden bytes), read from jax itself
(`jax.ad_checkpoint.saved_residuals` on abstract values: nothing runs).

    python bench/layer_residuals.py [--seq_len 4096] [--batch 1]

Prints one line per residual and a table beside Megatron's GPT formulas
(Korthikanti et al. 2022) for the llama_8b shape in bfloat16.
"""

import argparse
import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx
# jax 0.10 exports only the printing `jax.ad_checkpoint.print_saved_residuals`.
from jax._src.ad_checkpoint import saved_residuals

from meshtrain.models import llama

LLAMA_8B = llama.LlamaConfig(vocab_size=128_256, embed_dim=4096, num_layers=1, num_heads=32,
                             num_kv_heads=8, head_dim=128, mlp_dim=14_336, rope_theta=500_000.0,
                             compute_dtype="bfloat16")


@dataclasses.dataclass(frozen=True)
class Residual:
  shape: tuple[int, ...]
  dtype: str
  bytes: int
  source: str  # saved_residuals' note: "from the argument ..." or the line that made it


def layer_residuals(cfg: llama.LlamaConfig, batch: int, seq_len: int, remat: str,
                    param_dtype: str = "float32") -> list[Residual]:
  """The residuals of one layer's forward, its weights in `param_dtype`
  (config.param_dtype), the weights and positions left out: they exist
  anyway. The layer's input counts: the scan over layers stacks it."""
  dtype = jnp.dtype(cfg.compute_dtype)
  block = nnx.eval_shape(lambda: llama.Block(cfg, nnx.Rngs(0)))
  graphdef, state = nnx.split(block)
  state = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, param_dtype), state)
  x = jax.ShapeDtypeStruct((batch, seq_len, cfg.embed_dim), dtype)
  positions = jax.ShapeDtypeStruct((batch, seq_len), jnp.int32)

  def layer(state, x, positions):
    return nnx.merge(graphdef, state)(x, positions)

  if remat != "none":
    layer = jax.checkpoint(layer, policy=llama.REMAT_POLICIES[remat])
  saved = saved_residuals(layer, state, x, positions)
  return [Residual(tuple(a.shape), str(a.dtype), a.size * a.dtype.itemsize, note)
          for a, note in saved
          if not note.startswith(("from the argument state", "from the argument positions"))]


def sbh(residuals: list[Residual], batch: int, seq_len: int, embed_dim: int) -> float:
  return sum(r.bytes for r in residuals) / (batch * seq_len * embed_dim)


def megatron_sbh(cfg: llama.LlamaConfig, seq_len: int) -> dict[str, float]:
  """Korthikanti et al.'s GPT layer (t = 1): none 34 + 5as/h, selective 34, full 2."""
  a, h = cfg.num_heads, cfg.embed_dim
  return {"none": 34 + 5 * a * seq_len / h, "selective": 34.0, "full": 2.0}


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--seq_len", type=int, default=4096)
  parser.add_argument("--batch", type=int, default=1)
  parser.add_argument("--param_dtype", default="bfloat16", help="the weights' dtype (llama_8b's)")
  parser.add_argument("--verbose", action="store_true", help="list every residual")
  args = parser.parse_args()
  cfg, b, s = LLAMA_8B, args.batch, args.seq_len
  megatron = megatron_sbh(cfg, s)
  print(f"llama_8b layer, s={s}, b={b}, bfloat16 activations, {args.param_dtype} weights\n")
  print("| remat | meshtrain sbh | Megatron GPT sbh | largest residual |")
  print("|---|---|---|---|")
  for remat in ("none", "selective", "full"):
    residuals = layer_residuals(cfg, b, s, remat, args.param_dtype)
    if args.verbose:
      for r in sorted(residuals, key=lambda r: -r.bytes):
        print(f"  {remat:9s} {r.bytes / (b * s * cfg.embed_dim):8.2f} sbh {r.dtype:9s} "
              f"{r.shape} {r.source}")
    largest = max(residuals, key=lambda r: r.bytes)
    print(f"| {remat} | {sbh(residuals, b, s, cfg.embed_dim):.1f} | {megatron[remat]:.0f} | "
          f"{largest.dtype}{list(largest.shape)} |")


if __name__ == "__main__":
  main()
