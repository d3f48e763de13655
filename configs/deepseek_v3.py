"""DeepSeek-V3 shape (671B parameters, 37B active as published; here grouped-query
attention of the same width replaces Multi-head Latent Attention, so the counts
differ a little): 256 routed experts and 1 shared, top-8 by sigmoid scores
from the token's best 4 of 8 groups of experts, the first 3 layers dense,
auxiliary-loss-free balancing (a selection bias moved by 1e-3 a step) with a
small switch loss; planning (`meshtrain plan --search`)."""

from meshtrain.config import get_config as base_config


def get_config():
  c = base_config()
  c.model.update(vocab_size=129_280, embed_dim=7168, num_layers=61, num_heads=128,
                 num_kv_heads=8, head_dim=128, mlp_dim=18_432, rope_theta=10_000.0)
  c.model.moe.update(num_experts=256, experts_per_token=8, mlp_dim=2048, shared_mlp_dim=2048,
                     first_dense_layers=3, router="sigmoid", normalize_top_k=True,
                     expert_groups=8, groups_per_token=4,  # n_group, topk_group
                     route_scale=2.5, bias_update_rate=1e-3, aux_loss_coef=1e-4)
  c.global_batch = 15_360
  c.seq_len = 4096
  c.optimizer.learning_rate = 2.2e-4
  c.optimizer.warmup_steps = 2000
  c.compute_dtype = "bfloat16"
  c.param_dtype = "bfloat16"
  c.remat = "full"
  return c
