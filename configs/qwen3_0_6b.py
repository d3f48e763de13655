"""Qwen3-0.6B shape (0.60B parameters, 0.44B without the tied embedding): per-head
RMSNorm of q and k, tied embeddings; single-GPU runs and fine-tuning from scratch
shapes (`configs/finetune_hf.py:DIR` takes the shape from the checkpoint itself)."""

from meshtrain.config import get_config as base_config


def get_config():
  c = base_config()
  c.model.update(vocab_size=151_936, embed_dim=1024, num_layers=28, num_heads=16, num_kv_heads=8,
                 head_dim=128, mlp_dim=3072, rope_theta=1_000_000.0, norm_eps=1e-6,
                 tie_embeddings=True, qk_norm=True)
  c.global_batch = 64
  c.seq_len = 4096
  c.optimizer.learning_rate = 3e-4
  c.optimizer.warmup_steps = 1000
  c.compute_dtype = "bfloat16"
  c.param_dtype = "bfloat16"
  c.remat = "selective"
  return c
