"""Model FLOPs for MFU: the PaLM appendix-B count, 6N + 12·L·H·Q·T per token
(N weights touched by matmuls, L layers, H heads, Q head dim, T sequence length),
which counts training as forward + backward and ignores recomputation."""

import math

import jax

from meshtrain.models.llama import LlamaConfig


def matmul_params(model_cfg: LlamaConfig, abstract_params) -> int:
  """Weights used in matmuls: everything but norm scales, and the input
  embedding only when it doubles as the output head (a lookup is not a matmul)."""
  total = sum(math.prod(x.shape) for x in jax.tree.leaves(abstract_params))
  norms = sum(math.prod(x.shape) for path, x in jax.tree_util.tree_leaves_with_path(abstract_params)
              if getattr(path[-1], "key", None) == "scale")
  lookup = 0 if model_cfg.tie_embeddings else model_cfg.vocab_size * model_cfg.embed_dim
  return total - norms - lookup


def flops_per_token(model_cfg: LlamaConfig, abstract_params, seq_len: int) -> float:
  attention = 12 * model_cfg.num_layers * model_cfg.num_heads * model_cfg.head_dim * seq_len
  return 6 * matmul_params(model_cfg, abstract_params) + attention
