"""Model FLOPs for MFU: the PaLM appendix-B count, 6N + 12·L·H·Q·T per token
(N weights touched by matmuls, L layers, H heads, Q head dim, T sequence length;
6·L·H·(Qk + Qv)·T with Multi-head Latent Attention's query-key and value
widths), which counts training as forward + backward and ignores recomputation. A
Mixture-of-Experts model touches k of its E routed experts per token: N counts
k/E of the routed experts' weights (the active parameters), as DeepSeek-V3's
and Mixtral's reports do. Multi-token prediction modules (`mtp_layers`) count
as layers of attention, and each runs the output head once more."""

import dataclasses
import math

import jax

from meshtrain.models import mla
from meshtrain.models.llama import LlamaConfig

ROUTED = ("w_gate_ExDxF", "w_up_ExDxF", "w_down_ExFxD")  # the routed experts' weights


def _key(path) -> str:
  return getattr(path[-1], "key", "")


def total_params(abstract_params) -> int:
  return sum(math.prod(x.shape) for x in jax.tree.leaves(abstract_params))


def active_params(model_cfg: LlamaConfig, abstract_params) -> float:
  """Weights one token uses: all but the routed experts' (E - k)/E share."""
  moe = model_cfg.moe
  share = moe.experts_per_token / moe.num_experts if moe.num_experts else 1.0
  return sum(math.prod(x.shape) * (share if _key(path) in ROUTED else 1.0)
             for path, x in jax.tree_util.tree_leaves_with_path(abstract_params))


def matmul_params(model_cfg: LlamaConfig, abstract_params) -> float:
  """Active weights used in matmuls: everything but norm scales, and the input
  embedding only when it doubles as the output head (a lookup is not a matmul)."""
  norms = sum(math.prod(x.shape) for path, x in jax.tree_util.tree_leaves_with_path(abstract_params)
              if _key(path) == "scale")
  lookup = 0 if model_cfg.tie_embeddings else model_cfg.vocab_size * model_cfg.embed_dim
  return active_params(model_cfg, abstract_params) - norms - lookup


def attention_per_token(model_cfg, seq_len: int) -> float:
  """The attention's score and value matmuls a token, forward: 2·L·H·(Qk + Qv)·T,
  its query-key and value head widths (Q and Q, or Multi-head Latent
  Attention's own)."""
  qk, v, _ = mla.widths(model_cfg)
  layers = model_cfg.num_layers + model_cfg.mtp_layers
  return 2 * layers * model_cfg.num_heads * (qk + v) * seq_len


def mtp_per_token(model_cfg: LlamaConfig, abstract_params, seq_len: int) -> float:
  """The multi-token prediction modules' share of `flops_per_token` (their
  blocks, projections, attention and output heads: all on a pipeline's last
  stage)."""
  without = dataclasses.replace(model_cfg, mtp_layers=0)
  params = {key: tree for key, tree in abstract_params.items() if key != "mtp"}
  return (flops_per_token(model_cfg, abstract_params, seq_len)
          - flops_per_token(without, params, seq_len))


def flops_per_token(model_cfg: LlamaConfig, abstract_params, seq_len: int) -> float:
  heads_again = model_cfg.mtp_layers * model_cfg.vocab_size * model_cfg.embed_dim
  return (6 * (matmul_params(model_cfg, abstract_params) + heads_again)
          + 3 * attention_per_token(model_cfg, seq_len))
