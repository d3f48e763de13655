"""Mistral-7B (v0.1) shape (7.2B parameters): a 4096-token sliding attention window,
trained here on 8192-token sequences so that the window matters; multi-GPU runs and
planning. (v0.2 and later drop the window: set model.sliding_window=0.)"""

from meshtrain.config import get_config as base_config


def get_config():
  c = base_config()
  c.model.update(vocab_size=32_000, embed_dim=4096, num_layers=32, num_heads=32, num_kv_heads=8,
                 head_dim=128, mlp_dim=14_336, rope_theta=10_000.0, norm_eps=1e-5,
                 sliding_window=4096)
  c.global_batch = 128
  c.seq_len = 8192
  c.optimizer.learning_rate = 3e-4
  c.optimizer.warmup_steps = 2000
  c.compute_dtype = "bfloat16"
  c.param_dtype = "bfloat16"
  c.remat = "full"
  return c
