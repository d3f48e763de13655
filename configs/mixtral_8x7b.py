"""Mixtral 8x7B shape (46.7B parameters, 12.9B active): 8 experts, top-2, planning
(`meshtrain plan --search`) and multi-GPU runs."""

from meshtrain.config import get_config as base_config


def get_config():
  c = base_config()
  c.model.update(vocab_size=32_000, embed_dim=4096, num_layers=32, num_heads=32, num_kv_heads=8,
                 head_dim=128, mlp_dim=14_336, rope_theta=1_000_000.0)
  c.model.moe.update(num_experts=8, experts_per_token=2, router="softmax", normalize_top_k=True,
                     aux_loss_coef=0.04)  # transformers' router_aux_loss_coef 0.02 on k x this loss
  c.global_batch = 1024
  c.seq_len = 4096
  c.optimizer.learning_rate = 3e-4
  c.optimizer.warmup_steps = 2000
  c.compute_dtype = "bfloat16"
  c.param_dtype = "bfloat16"
  c.remat = "full"
  return c
