"""DeepSeek-V3 (671B parameters, 37B active as published): Multi-head Latent
Attention (query latent 1536, key-value latent 512, heads of 128 + 64 rotated
dimensions, YaRN RoPE as its config.json sets it), 256 routed experts and 1
shared, top-8 by sigmoid scores from the token's best 4 of 8 groups of
experts, the first 3 layers dense, auxiliary-loss-free balancing (a selection
bias moved by 1e-3 a step) with a small switch loss, and one multi-token
prediction module (its loss weighed 0.1, as in the last 4.8T tokens of its
training; 0.3 before); planning (`meshtrain plan --search`)."""

from meshtrain.config import get_config as base_config


def get_config():
  c = base_config()
  c.model.update(vocab_size=129_280, embed_dim=7168, num_layers=61, num_heads=128,
                 num_kv_heads=128, head_dim=128, mlp_dim=18_432, rope_theta=10_000.0,
                 norm_eps=1e-6, rope_scaling_type="yarn", rope_scaling_factor=40.0,
                 rope_original_max_positions=4096, rope_mscale=1.0, rope_mscale_all_dim=1.0)
  c.model.mla.update(kv_lora_rank=512, q_lora_rank=1536, rope_head_dim=64, v_head_dim=128)
  c.model.moe.update(num_experts=256, experts_per_token=8, mlp_dim=2048, shared_mlp_dim=2048,
                     first_dense_layers=3, router="sigmoid", normalize_top_k=True,
                     expert_groups=8, groups_per_token=4,  # n_group, topk_group
                     route_scale=2.5, bias_update_rate=1e-3, aux_loss_coef=1e-4)
  c.model.mtp_layers = 1  # model.mtp_loss_coef: 0.1 by default
  c.global_batch = 15_360
  c.seq_len = 4096
  c.optimizer.learning_rate = 2.2e-4
  c.optimizer.warmup_steps = 2000
  c.compute_dtype = "bfloat16"
  c.param_dtype = "bfloat16"
  c.remat = "full"
  return c
