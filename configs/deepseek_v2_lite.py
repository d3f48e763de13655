"""DeepSeek-V2-Lite (15.7B parameters, 2.4B active as published): Multi-head
Latent Attention without a query latent (key-value latent 512, heads of 128 +
64 rotated dimensions, YaRN RoPE as its config.json sets it), 64 routed
experts and 2 shared, top-6 by softmax, the weights not renormalised, the
first layer dense (the `deepseek_v2` family); the training settings of the
DeepSeek-V3 preset, without its selection bias and multi-token prediction."""

from pathlib import Path

from meshtrain.config import load


def get_config():
  c = load(Path(__file__).with_name("deepseek_v3.py"))
  c.model.update(vocab_size=102_400, embed_dim=2048, num_layers=27, num_heads=16,
                 num_kv_heads=16, mlp_dim=10_944, rope_mscale=0.707, rope_mscale_all_dim=0.707)
  c.model.mla.update(q_lora_rank=0)
  c.model.moe.update(num_experts=64, experts_per_token=6, mlp_dim=1408, shared_mlp_dim=2816,
                     first_dense_layers=1, router="softmax", normalize_top_k=False,
                     expert_groups=1, groups_per_token=0, route_scale=1.0, bias_update_rate=0.0,
                     aux_loss_coef=0.001)
  c.model.mtp_layers = 0
  return c
