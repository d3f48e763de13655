"""Qwen2.5-7B shape (7.6B parameters): biases on the q, k and v projections, 28 query
heads over 4 kv heads; multi-GPU runs and planning."""

from meshtrain.config import get_config as base_config


def get_config():
  c = base_config()
  c.model.update(vocab_size=152_064, embed_dim=3584, num_layers=28, num_heads=28, num_kv_heads=4,
                 head_dim=128, mlp_dim=18_944, rope_theta=1_000_000.0, norm_eps=1e-6,
                 qkv_bias=True)
  c.global_batch = 256
  c.seq_len = 4096
  c.optimizer.learning_rate = 3e-4
  c.optimizer.warmup_steps = 2000
  c.compute_dtype = "bfloat16"
  c.param_dtype = "bfloat16"
  c.remat = "full"
  return c
