"""Qwen3-30B-A3B shape (30.5B parameters, 3.3B active): 128 experts, top-8, per-head
RMSNorm of q and k; planning and multi-GPU runs."""

from meshtrain.config import get_config as base_config


def get_config():
  c = base_config()
  c.model.update(vocab_size=151_936, embed_dim=2048, num_layers=48, num_heads=32, num_kv_heads=4,
                 head_dim=128, mlp_dim=6144, rope_theta=1_000_000.0, norm_eps=1e-6,
                 qk_norm=True)
  c.model.moe.update(num_experts=128, experts_per_token=8, mlp_dim=768, router="softmax",
                     normalize_top_k=True,  # norm_topk_prob
                     aux_loss_coef=0.008)  # transformers' router_aux_loss_coef 0.001 on k x this loss
  c.global_batch = 1024
  c.seq_len = 4096
  c.optimizer.learning_rate = 3e-4
  c.optimizer.warmup_steps = 2000
  c.compute_dtype = "bfloat16"
  c.param_dtype = "bfloat16"
  c.remat = "full"
  return c
