"""Llama 3 70B shape (70.6B parameters): planning (`meshtrain plan --search`)."""

from meshtrain.config import get_config as base_config


def get_config():
  c = base_config()
  c.model.update(vocab_size=128_256, embed_dim=8192, num_layers=80, num_heads=64, num_kv_heads=8,
                 head_dim=128, mlp_dim=28_672, rope_theta=500_000.0)
  c.global_batch = 512
  c.seq_len = 8192
  c.compute_dtype = "bfloat16"
  c.param_dtype = "bfloat16"
  c.remat = "full"
  return c
