"""Qwen1.5-MoE-A2.7B shape (14.3B parameters, 2.7B active): 60 experts, top-4,
unnormalised weights, and a shared expert gated per token (the `qwen2_moe`
family); the training settings of the Qwen3-30B-A3B preset."""

from pathlib import Path

from meshtrain.config import load


def get_config():
  c = load(Path(__file__).with_name("qwen3_30b_a3b.py"))
  c.model.update(num_layers=24, num_heads=16, num_kv_heads=16, mlp_dim=5632, qkv_bias=True,
                 qk_norm=False)
  c.model.moe.update(num_experts=60, experts_per_token=4, mlp_dim=1408, shared_mlp_dim=5632,
                     shared_gate=True, normalize_top_k=False,  # norm_topk_prob
                     aux_loss_coef=0.004)  # transformers' router_aux_loss_coef 0.001 on k x this loss
  return c
