"""Multi-head Latent Attention (`meshtrain/models/mla.py`; transformers'
DeepSeek-V3 computes the same logits: tests/test_hf_families.py): every
strategy trains it equal to the same model on one device, its latent weights
are split as the rules say, and plan counts its parameters and FLOPs."""

import math
import types

import jax
import pytest
from jax.sharding import PartitionSpec as P

from conftest import REPO, micro_config, tiered
from equivalence import assert_matches_one_device
from reference import random_batches
from test_plan import by_axis, executed_collectives
from meshtrain.config import load
from meshtrain.mesh import AXES
from meshtrain.models import flops, mla
from meshtrain.parallel import attention
from meshtrain.planner import clusters, search
from meshtrain.planner.plan import analytic
from meshtrain.train.parallelize import model_config
from meshtrain.train.setup import build

STEPS = 4
# Query latent 24 wide, key-value latent 16; heads of 8 + 4 rotated dims, values 6 wide.
MLA = {"model.num_kv_heads": 4, "model.mla.kv_lora_rank": 16, "model.mla.q_lora_rank": 24,
       "model.mla.rope_head_dim": 4, "model.mla.v_head_dim": 6}
DEEPSEEK_MOE = dict(model=dict(moe=dict(num_experts=8, experts_per_token=2, mlp_dim=16,
                                        shared_mlp_dim=16, router="sigmoid", route_scale=2.5,
                                        expert_groups=2, groups_per_token=1,
                                        first_dense_layers=1, aux_loss_coef=0.0)))

COMPOSITIONS = {
    "fsdp=8": dict(mesh=dict(data=1, fsdp=8)),
    "fsdp=8 no query latent, values wider than keys": dict(
        mesh=dict(data=1, fsdp=8), model=dict(mla=dict(q_lora_rank=0, v_head_dim=16))),
    "data=2 fsdp=4 zero3": dict(mesh=dict(data=2, fsdp=4), zero_stage=3),
    "tensor=2 fsdp=4 sequence parallel": dict(mesh=dict(data=1, fsdp=4, tensor=2),
                                              tensor_sequence_parallel=True),
    **{f"sequence=2 fsdp=4 {s}": dict(mesh=dict(data=1, fsdp=4, sequence=2),
                                      attention=dict(sequence_strategy=s))
       for s in ("all_gather_kv", "ulysses", "ring")},
    "pipeline=2 fsdp=4 1f1b": dict(mesh=dict(data=1, fsdp=4, pipeline=2),
                                   pipeline=dict(microbatches=2)),
    "pipeline=2 fsdp=2 tensor=2 zb_h1": dict(mesh=dict(data=1, fsdp=2, tensor=2, pipeline=2),
                                             pipeline=dict(schedule="zb_h1", microbatches=4)),
    "fsdp=8 remat=selective accumulate 2": dict(mesh=dict(data=1, fsdp=8), remat="selective",
                                                grad_accum_steps=2),
    "fsdp=8 YaRN (DeepSeek's mscales)": dict(
        mesh=dict(data=1, fsdp=8), model=dict(rope_scaling_type="yarn", rope_scaling_factor=4.0,
                                              rope_original_max_positions=8, rope_mscale=1.0,
                                              rope_mscale_all_dim=0.7)),
    "tensor=2 fsdp=4 sequence parallel, DeepSeek-V3's experts": dict(
        mesh=dict(data=1, fsdp=4, tensor=2), tensor_sequence_parallel=True, **DEEPSEEK_MOE),
}


@pytest.mark.parametrize("case", tiered(COMPOSITIONS, ("tensor=2 fsdp=4 sequence parallel",
                                                       "sequence=2 fsdp=4 ring")))
def test_mla_training_matches_unsharded_plain_jit(case):
  cfg = micro_config(**MLA)
  cfg.update(COMPOSITIONS[case])  # nested dicts update sub-configs key by key
  batches = random_batches(STEPS, cfg.global_batch, cfg.seq_len, cfg.model.vocab_size)
  assert_matches_one_device(cfg, batches)


TRAFFIC = {
    "tp": dict(mesh=dict(data=2, tensor=4)),
    "tp+sp": dict(mesh=dict(data=2, tensor=4), tensor_sequence_parallel=True),
    "tp+sp full remat": dict(mesh=dict(data=2, tensor=4), tensor_sequence_parallel=True,
                             remat="full"),
    "3d": dict(mesh=dict(data=2, pipeline=2, tensor=2), tensor_sequence_parallel=True,
               pipeline=dict(microbatches=2)),
}


@pytest.mark.parametrize("strategy", tiered(TRAFFIC, ("tp+sp",)))
def test_latent_attention_traffic_matches_the_analytic_model(strategy):
  """Under `tensor` the attention's backward sums the latents' gradients (q
  latent, kv latent and the shared rotated key: 44 a token here), not the
  block input's (32); plan counts that: executed bytes within 10% on each
  axis, the all-reduces over `tensor` within 20% (Megatron-SP's count alone
  gave a quarter of them)."""
  cfg = micro_config(**MLA)
  cfg.update(TRAFFIC[strategy])
  setup = build(cfg)
  executed = executed_collectives(setup)
  planned = analytic(cfg, setup.spec, setup.rules, setup.mesh)["collectives"]
  measured, predicted = by_axis(executed), by_axis(planned)
  assert set(measured) == set(predicted) != set()
  for axis in measured:
    assert measured[axis] == pytest.approx(predicted[axis], rel=0.10), axis
  summed = [sum(c["bytes"] for c in collectives if (c["kind"], c["axis"]) == ("all-reduce",
                                                                               "tensor"))
            for collectives in (executed, planned)]
  assert summed[0] == pytest.approx(summed[1], rel=0.20)


def test_the_latent_weights_are_split_by_fsdp_and_their_heads_by_tensor():
  """A weight with no `embed` dimension (the up-projections) splits its latent
  over fsdp; the down-projections split `embed` and keep the latent whole, so
  the latents need no gather of their own under tensor."""
  setup = build(micro_config(**MLA, **{"mesh.data": 1, "mesh.fsdp": 4, "mesh.tensor": 2}))
  specs = jax.tree.map(lambda s: s.spec, setup.shardings.params["layers"]["attn"])
  assert specs["wq_down_DxR"] == P(None, "fsdp", None)
  assert specs["wkv_down_DxC"] == P(None, "fsdp", None)
  assert specs["wq_up_RxNxH"] == P(None, "fsdp", "tensor", None)
  assert specs["wkv_up_CxNxH"] == P(None, "fsdp", "tensor", None)
  assert specs["wo_NxHxD"] == P(None, "tensor", None, "fsdp")


def test_flops_count_the_query_key_and_value_widths():
  """6N + 6·L·H·(Qk + Qv)·T: the scores over heads of 8 + 4 dims, the values 6 wide."""
  cfg = micro_config(**MLA)
  model = model_config(cfg)
  setup = build(cfg, jax.devices()[:1])
  n = flops.matmul_params(model, setup.spec.abstract_params)
  layers, heads, t = cfg.model.num_layers, cfg.model.num_heads, cfg.seq_len
  assert flops.flops_per_token(model, setup.spec.abstract_params, t) == pytest.approx(
      6 * n + 6 * layers * heads * (12 + 6) * t)
  d, r, c, h = 32, 24, 16, 4
  attention = d * r + r + r * h * 12 + d * (c + 4) + c + c * h * (8 + 6) + h * 6 * d
  assert math.prod(setup.spec.abstract_params["layers"]["attn"]["wkv_up_CxNxH"].shape) == (
      layers * c * h * 14)
  assert sum(x.size for x in jax.tree.leaves(setup.spec.abstract_params["layers"]["attn"])) == (
      layers * attention)


@pytest.mark.parametrize("rope_head_dim, flash", [(8, True), (124, False)])
def test_the_planner_gives_flash_attention_only_heads_it_takes(rope_head_dim, flash):
  """Heads 8 + 8 wide fit cuDNN's flash attention on an H100 (no scores kept);
  8 + 124 = 132 do not, so their attention keeps its scores, as it will run."""
  cfg = micro_config(**{**MLA, "model.mla.rope_head_dim": rope_head_dim})
  model = search.StepModel(cfg, clusters.PRESETS["h100"])
  assert model.flash is flash
  candidate = search.Candidate(mesh=tuple((axis, 1) for axis in AXES))
  assert (model.score_elements(candidate, cfg, rows=2) > 0) is not flash


def test_deepseek_v3s_heads_run_at_192_beyond_cudnn_flash_attention():
  """The README's cost of padding: DeepSeek-V3's 128-wide values beside
  192-wide queries and keys run at 192, which the best kernel on an H100
  leaves to XLA's attention (cuDNN's flash takes up to 128)."""
  model = load(REPO / "configs" / "deepseek_v3.py").model
  assert mla.widths(model) == (192, 128, 192)
  h100 = types.SimpleNamespace(platform="gpu", device_kind="NVIDIA H100 80GB HBM3")
  assert attention.implementation_for("", "bfloat16", mla.widths(model)[2], h100) == "xla"
