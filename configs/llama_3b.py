"""Llama 3.2 3B shape (3.21B parameters, tied embeddings): the largest preset
whose float32 master weights and AdamW state (51 GB) fit one 80 GB GPU."""

from meshtrain.config import get_config as base_config


def get_config():
  c = base_config()
  c.model.update(vocab_size=128_256, embed_dim=3072, num_layers=28, num_heads=24, num_kv_heads=8,
                 head_dim=128, mlp_dim=8192, rope_theta=500_000.0, tie_embeddings=True)
  c.global_batch = 32
  c.seq_len = 2048
  c.optimizer.learning_rate = 3e-4
  c.optimizer.warmup_steps = 500
  c.compute_dtype = "bfloat16"
  c.param_dtype = "bfloat16"
  c.remat = "full"
  return c
