"""The Mixture-of-Experts layer against a plain loop over experts written here
(values and gradients, the switch loss's included), on one device and with the
experts split over mesh axes; its balance and capacity rules; the switch loss
against transformers'."""

import dataclasses
import functools
import json
import math
import re
import types

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from jax.sharding import NamedSharding
from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

import pairs
from conftest import REPO, micro_config, step_collectives, tiered
from equivalence import assert_matches_one_device, meshtrain_run
from reference import random_batches
from meshtrain import rules as r
from meshtrain.analysis import hlo
from meshtrain.config import load
from meshtrain.mesh import make_mesh
from meshtrain.models import moe as moe_lib
from meshtrain.models.layers import MLP
from meshtrain.models.moe import MoE, MoEConfig, top_k_indices, update_bias
from meshtrain.parallel import experts, hopper_gemm
from meshtrain.planner.plan import compile_step, plan
from meshtrain.train.loop import train
from meshtrain.train.setup import build
from meshtrain.workdir import load_model_state

D, F = 16, 24
STEPS = 4


@pytest.fixture(autouse=True)
def hopper_kernels_as_xla_ragged_dots(monkeypatch):
  """`grouped_gemm=hopper` on the CPU: its Mosaic GPU kernels replaced by XLA's
  ragged dots in the kernels' output dtype, with the rows the kernels leave
  unwritten set to NaN. So its custom gradient, its masking and the layout
  around it are what the tests here check; bench/moe_gemm.py checks the
  kernels themselves against `tiled` on a GPU."""
  def product(lhs_NxK, rhs, groups_G, transpose_rhs):
    rhs_GxKxF = jnp.swapaxes(rhs, 1, 2) if transpose_rhs else rhs
    y_NxF = jax.lax.ragged_dot(lhs_NxK, rhs_GxKxF, groups_G)
    return jnp.where((jnp.arange(y_NxF.shape[0]) < jnp.sum(groups_G))[:, None], y_NxF, jnp.nan)

  def group_gram(x_NxK, dy_NxF, groups_G):
    return jax.lax.ragged_dot_general(
        x_NxK, dy_NxF, groups_G, jax.lax.RaggedDotDimensionNumbers(
            dot_dimension_numbers=(((0,), (0,)), ((), ())), lhs_ragged_dimensions=[0],
            rhs_group_dimensions=[]))

  monkeypatch.setattr(hopper_gemm, "_product", product)
  monkeypatch.setattr(hopper_gemm, "_group_gram", group_gram)


def plain_moe(x_BxLxD, router_DxE, w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD, cfg: MoEConfig,
              bias_E=None, dropped_BxLxK=None):
  """Routing and every expert on every token, plainly: the reference. Returns
  the output and the switch loss (differentiable)."""
  num_experts, k = router_DxE.shape[1], cfg.experts_per_token
  logits = jnp.einsum("bld,de->ble", x_BxLxD, router_DxE)
  scores = jax.nn.softmax(logits, -1) if cfg.router == "softmax" else jax.nn.sigmoid(logits)
  selection = jax.lax.stop_gradient(scores) + (0 if bias_E is None else bias_E)
  if cfg.groups_per_token:  # only the experts of the best groups by their best few
    grouped = selection.reshape(*selection.shape[:-1], cfg.expert_groups, -1)
    group_score = -jnp.sort(-grouped, axis=-1)[..., :cfg.group_scored_by].sum(-1)
    worst_groups = jnp.argsort(-group_score, axis=-1)[..., cfg.groups_per_token:]
    for g in range(cfg.expert_groups):
      dropped_group = jnp.any(worst_groups == g, axis=-1, keepdims=True)
      grouped = grouped.at[..., g, :].set(jnp.where(dropped_group, -jnp.inf, grouped[..., g, :]))
    selection = grouped.reshape(selection.shape)
  chosen = jnp.argsort(-selection, axis=-1)[..., :k]
  weights = jnp.take_along_axis(scores, chosen, axis=-1)
  if cfg.normalize_top_k:
    weights = weights / weights.sum(-1, keepdims=True)
  weights = weights * cfg.route_scale
  if dropped_BxLxK is not None:
    weights = jnp.where(dropped_BxLxK, 0.0, weights)
  y = jnp.zeros_like(x_BxLxD)
  for e in range(num_experts):
    out = (jax.nn.silu(x_BxLxD @ w_gate_ExDxF[e]) * (x_BxLxD @ w_up_ExDxF[e])) @ w_down_ExFxD[e]
    y = y + jnp.sum(jnp.where(chosen == e, weights, 0.0), -1, keepdims=True) * out
  probs = scores / scores.sum(-1, keepdims=True)
  share = jax.nn.one_hot(chosen, num_experts).sum(2).mean((0, 1)) / k
  aux = num_experts * jnp.sum(share * probs.mean((0, 1)))
  return y, aux


def mesh_of(**sizes):
  devices = jax.devices()[:math.prod(sizes.values())]
  return make_mesh({"data": 1, "pipeline": 1, "fsdp": 1, "sequence": 1, "tensor": 1, **sizes},
                   devices)


def layer(cfg: MoEConfig, experts_fn=experts.grouped_experts, seed=0) -> MoE:
  return MoE(D, F, cfg, nnx.Rngs(seed), experts_fn)


def inputs(batch=4, length=8, seed=1):
  kx, kc = jax.random.split(jax.random.key(seed))
  return jax.random.normal(kx, (batch, length, D)), jax.random.normal(kc, (batch, length, D))


def weights_of(moe: MoE):
  return tuple(v[...] for v in (moe.router_DxE, moe.w_gate_ExDxF, moe.w_up_ExDxF,
                                moe.w_down_ExFxD))


def layer_value_and_grads(moe: MoE, x, cotangent):
  """sum(y * cotangent) and its gradients w.r.t. x and the weights, through
  the layer (whose switch loss gradient is injected, not summed in)."""
  graphdef, params, state = nnx.split(moe, nnx.Param, nnx.BatchStat)

  def loss(x, params):
    y, stats = nnx.merge(graphdef, params, state).forward(x)
    return jnp.sum(y * cotangent), (y, stats)
  (_, (y, stats)), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(x, params)
  dx, dparams = grads
  names = ("router_DxE", "w_gate_ExDxF", "w_up_ExDxF", "w_down_ExFxD")
  return y, stats, (dx, *(dparams[n][...] for n in names))


def plain_value_and_grads(moe: MoE, x, cotangent, cfg: MoEConfig, **plain):
  def loss(x, router, gate, up, down):
    y, aux = plain_moe(x, router, gate, up, down, cfg, **plain)
    return jnp.sum(y * cotangent) + cfg.aux_loss_coef * aux, y
  (_, y), grads = jax.value_and_grad(loss, argnums=tuple(range(5)), has_aux=True)(
      x, *weights_of(moe))
  return y, grads


def assert_close(got, want, tolerance=1e-5):
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    scale = float(jnp.max(jnp.abs(w))) or 1.0
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=tolerance * scale, rtol=1e-4)


CONFIGS = {
    "softmax top-2 of 8": MoEConfig(num_experts=8, experts_per_token=2),
    "sigmoid top-4 of 8, scaled": MoEConfig(num_experts=8, experts_per_token=4, router="sigmoid",
                                            route_scale=2.5),
    "softmax top-2 unnormalised, no aux": MoEConfig(num_experts=4, experts_per_token=2,
                                                   normalize_top_k=False, aux_loss_coef=0.0),
    "sigmoid top-3 of 16 in the best 2 of 4 groups": MoEConfig(
        num_experts=16, experts_per_token=3, router="sigmoid", expert_groups=4,
        groups_per_token=2),
    # DeepSeek-V2's group_limited_greedy: groups scored by their best expert
    "softmax top-3 of 16 unnormalised in the best 2 of 4 groups by their best": MoEConfig(
        num_experts=16, experts_per_token=3, normalize_top_k=False, expert_groups=4,
        groups_per_token=2, group_scored_by=1),
}


@pytest.mark.parametrize("gemm", experts.GEMMS)
@pytest.mark.parametrize("name", CONFIGS)
def test_layer_equals_a_plain_loop_over_experts_values_and_gradients(name, gemm):
  """The switch loss's gradient included: meshtrain injects it into the
  backward, the reference differentiates coef x loss."""
  cfg = CONFIGS[name]
  moe = layer(cfg, functools.partial(experts.grouped_experts, gemm=gemm))
  x, cotangent = inputs()
  y, stats, grads = layer_value_and_grads(moe, x, cotangent)
  ref_y, ref_grads = plain_value_and_grads(moe, x, cotangent, cfg)
  assert_close(y, ref_y)
  assert_close(grads, ref_grads)
  _, ref_aux = plain_moe(x, *weights_of(moe), cfg)
  np.testing.assert_allclose(float(stats.aux_loss), float(ref_aux), rtol=1e-6)


@pytest.mark.parametrize("router", moe_lib.ROUTERS)
def test_the_switch_loss_moves_the_router_as_its_reference_does(router):
  """What the switch loss adds to the router's gradient, alone: layer and
  plain loop with the coefficient at 1 minus the same at 0. A sigmoid
  router's weights come from its scores, not the loss's probabilities, and
  once the loss's gradient was injected where nothing read it: the layer's
  difference was 0, the reference's 5e-3 (of gradients near 3)."""
  x, cotangent = inputs()
  added = []
  for coef in (0.0, 1.0):
    cfg = MoEConfig(num_experts=8, experts_per_token=2, router=router, aux_loss_coef=coef)
    moe = layer(cfg)
    added.append((layer_value_and_grads(moe, x, cotangent)[2][1],
                  plain_value_and_grads(moe, x, cotangent, cfg)[1][1]))
  (got_0, want_0), (got_1, want_1) = added
  assert float(jnp.abs(want_1 - want_0).max()) > 1e-3
  # float32 rounding of the gradients themselves, not of their difference
  np.testing.assert_allclose(got_1 - got_0, want_1 - want_0,
                             atol=1e-5 * float(jnp.abs(want_1).max()))


@pytest.mark.parametrize("sizes", [(1, 1, 1, 61), (5, 5, 5, 49), (0, 0, 0, 64), (16, 16, 16, 16)])
def test_tiles_hold_every_row_when_each_expert_pads_a_tile(sizes):
  """64 rows over 4 experts in tiles of 4: (1, 1, 1, 61) and (5, 5, 5, 49)
  fill the static bound (16 + 4 - 1 tiles) exactly; every row still comes out."""
  assert experts.tile_rows(64, 4) == 4
  expert_N = np.random.default_rng(0).permutation(np.repeat(np.arange(4), sizes))
  kw, kx = jax.random.split(jax.random.key(0))
  gate, up, down = (jax.random.normal(k, shape) for k, shape in zip(
      jax.random.split(kw, 3), [(4, D, F), (4, D, F), (4, F, D)]))
  x_NxD = jax.random.normal(kx, (64, D))
  y = experts.grouped_experts(x_NxD[None], jnp.asarray(expert_N)[None, :, None],
                              jnp.ones((1, 64, 1)), gate, up, down, gemm="tiled")[0]
  want = jnp.stack([(jax.nn.silu(x @ gate[e]) * (x @ up[e])) @ down[e]
                    for x, e in zip(x_NxD, expert_N)])
  np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)


def activation_scatters(compiled) -> list[str]:
  """The shapes of the compiled program's floating-point scatters other than
  into an expert weight's shape (the tiled GEMM sums its per-tile weight
  gradients by expert)."""
  module = hlo._parse_module(compiled.as_text())
  weights = re.compile(rf"b?f\d+\[\d+,({D},{F}|{F},{D})\]")
  return [i.shape for i in module.instructions() if i.opcode == "scatter"
          and i.shape.lstrip("(").startswith(("f", "bf")) and not weights.match(i.shape)]


@pytest.mark.parametrize("gemm", experts.GEMMS)
def test_tokens_reach_the_experts_and_return_by_gathers_forward_and_backward(gemm):
  """No scatter of activations (a GPU adds each row atomically) in the compiled
  forward and backward of the routed experts, on one device and with 8
  experts over fsdp=4; only integer scatters, which invert the routing. The
  plain-loop tests above check the gradients these gathers give."""
  moe = layer(CONFIGS["softmax top-2 of 8"])
  x, cotangent = inputs(batch=8, length=8)
  expert_BxLxK = jnp.asarray(np.argsort(np.random.default_rng(0).random((8, 8, 8)))[..., :2])
  weight_BxLxK = jnp.full((8, 8, 2), 0.5)

  def grads(experts_fn):
    def loss(x, gate, up, down):
      y = experts_fn(x, expert_BxLxK, weight_BxLxK, gate, up, down, gemm=gemm)
      return jnp.sum(y * cotangent)
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))
  weights = weights_of(moe)[1:]
  assert activation_scatters(grads(experts.grouped_experts).lower(x, *weights).compile()) == []
  mesh = mesh_of(fsdp=4)
  rules = r.strategy_rules(mesh, expert_axes=("fsdp",))
  with jax.set_mesh(mesh), nnx.logical_axis_rules(rules.params):
    tokens = NamedSharding(mesh, r.logical_to_spec((r.BATCH, r.LENGTH), rules.params))
    split = grads(functools.partial(experts.expert_parallel, axes=("fsdp",))).lower(
        jax.device_put(x, tokens), *weights).compile()
  assert activation_scatters(split) == []


def test_one_expert_top_one_is_the_dense_mlp():
  cfg = MoEConfig(num_experts=1, experts_per_token=1)
  moe = layer(cfg)
  dense = MLP(D, F, nnx.Rngs(0))
  dense.w_gate_DxF[...] = moe.w_gate_ExDxF[0]
  dense.w_up_DxF[...] = moe.w_up_ExDxF[0]
  dense.w_down_FxD[...] = moe.w_down_ExFxD[0]
  x, _ = inputs()
  np.testing.assert_allclose(moe(x), dense(x), rtol=1e-5, atol=1e-6)


def test_the_deepseek_v3_layer_computes_transformers_deepseek_v3_moe():
  """transformers' DeepseekV3MoE (sigmoid scores with a correction bias, the
  best 2 of 4 groups by their two highest scores, top-3 renormalised and
  scaled by 2.5, a shared expert) with its weights drawn at random, against
  meshtrain's layer holding the same weights."""
  from transformers.models.deepseek_v3 import modeling_deepseek_v3 as deepseek

  hf_cfg = deepseek.DeepseekV3Config(hidden_size=D, moe_intermediate_size=F, n_routed_experts=16,
                                     n_group=4, topk_group=2, num_experts_per_tok=3,
                                     n_shared_experts=1, routed_scaling_factor=2.5)
  torch.manual_seed(0)
  hf = deepseek.DeepseekV3MoE(hf_cfg).eval()
  with torch.no_grad():
    for weight in [*hf.parameters(), *hf.buffers()]:
      weight.copy_(0.3 * torch.randn_like(weight))
  cfg = MoEConfig(num_experts=16, experts_per_token=3, router="sigmoid", route_scale=2.5,
                  expert_groups=4, groups_per_token=2, shared_mlp_dim=F)
  moe = layer(cfg)
  numpy = lambda t: jnp.asarray(t.detach().numpy())  # noqa: E731
  gate_up = numpy(hf.experts.gate_up_proj)  # [E, 2F, D]
  moe.router_DxE[...] = numpy(hf.gate.weight).T
  moe.bias_E[...] = numpy(hf.gate.e_score_correction_bias)
  moe.w_gate_ExDxF[...] = gate_up[:, :F].transpose(0, 2, 1)
  moe.w_up_ExDxF[...] = gate_up[:, F:].transpose(0, 2, 1)
  moe.w_down_ExFxD[...] = numpy(hf.experts.down_proj).transpose(0, 2, 1)
  for name in ("gate", "up", "down"):
    getattr(moe.shared, f"w_{name}_{'FxD' if name == 'down' else 'DxF'}")[...] = numpy(
        getattr(hf.shared_experts, f"{name}_proj").weight).T
  x, _ = inputs()
  with torch.no_grad():
    expected = hf(torch.as_tensor(np.asarray(x))).numpy()
  np.testing.assert_allclose(moe(x), expected, rtol=1e-5, atol=1e-5)


def test_auto_gemm_is_hopper_only_where_its_kernels_run():
  hopper = types.SimpleNamespace(platform="gpu", compute_capability="9.0", device_kind="NVIDIA H200")
  ampere = types.SimpleNamespace(platform="gpu", compute_capability="8.0", device_kind="NVIDIA A100")
  aligned = {"embed": 2048, "hidden": 768}
  assert experts.gemm_for("auto", "bfloat16", aligned, hopper) == "hopper"
  assert experts.gemm_for("auto", "float16", aligned, hopper) == "hopper"
  assert experts.gemm_for("auto", "float32", aligned, hopper) == "tiled"
  assert experts.gemm_for("auto", "bfloat16", {"embed": 2048, "hidden": 96}, hopper) == "tiled"
  assert experts.gemm_for("auto", "bfloat16", aligned, ampere) == "tiled"
  assert experts.gemm_for("auto", "bfloat16", aligned, jax.devices()[0]) == "tiled"
  assert experts.gemm_for("ragged_dot", "bfloat16", aligned, hopper) == "ragged_dot"
  assert "hidden is 96" in hopper_gemm.unsupported(hopper, "bfloat16", {"hidden": 96})


@pytest.mark.parametrize("gemm", experts.GEMMS)
def test_dropless_drops_nothing_and_capacity_drops_exactly_what_it_reports(gemm):
  x, cotangent = inputs(length=16)
  dropless = MoEConfig(num_experts=4, experts_per_token=2, aux_loss_coef=0.0)
  moe = layer(dropless, functools.partial(experts.grouped_experts, gemm=gemm))
  # A router that sends most tokens to expert 0: at capacity factor 1 it overflows.
  moe.router_DxE[...] = moe.router_DxE[...].at[:, 0].add(2.0)
  assert float(moe.forward(x)[1].dropped) == 0
  capped = dataclasses.replace(dropless, capacity_factor=1.0)
  moe.cfg = capped
  y, stats = moe.forward(x)
  capacity = capped.capacity(x.shape[1])  # ceil(1 x 16 x 2 / 4) = 8 per sequence and expert
  logits = jnp.einsum("bld,de->ble", x, moe.router_DxE[...])
  chosen = jnp.argsort(-logits, axis=-1)[..., :2]
  # The reference's own account of which assignments overflow: by position, then rank.
  dropped = np.zeros(chosen.shape, bool)
  for b in range(chosen.shape[0]):
    taken = np.zeros(4, int)
    for t in range(chosen.shape[1]):
      for j in range(2):
        e = int(chosen[b, t, j])
        dropped[b, t, j] = taken[e] >= capacity
        taken[e] += 1
  assert dropped.sum() > 0 and float(stats.dropped) == dropped.sum()
  ref_y, _ = plain_moe(x, *weights_of(moe), capped, dropped_BxLxK=jnp.asarray(dropped))
  np.testing.assert_allclose(y, ref_y, rtol=1e-5, atol=1e-5)


def test_the_router_picks_what_top_k_picks_ties_to_the_lower_expert():
  """The k argmaxes the router chooses by (XLA splits them along the tokens;
  it gathers every token's scores for a top_k) pick what `lax.top_k` picks, in
  its order, a tie going to the lower expert."""
  scores = jnp.asarray(np.random.default_rng(0).integers(0, 4, (3, 64, 8)), jnp.float32)
  for k in (1, 2, 8):
    np.testing.assert_array_equal(top_k_indices(scores, k), jax.lax.top_k(scores, k)[1])


def test_the_switch_loss_of_a_uniform_router_is_one_and_k_times_it_is_transformers():
  cfg = MoEConfig(num_experts=8, experts_per_token=2)
  moe = layer(cfg)
  x, _ = inputs()
  moe.router_DxE[...] = jnp.zeros_like(moe.router_DxE[...])
  assert float(moe.forward(x)[1].aux_loss) == pytest.approx(1.0, abs=1e-6)
  moe = layer(cfg, seed=3)
  aux = float(moe.forward(x)[1].aux_loss)
  logits = jnp.einsum("bld,de->ble", x, moe.router_DxE[...]).reshape(-1, 8)
  theirs = load_balancing_loss_func((torch.tensor(np.asarray(logits)),), 8, top_k=2)
  assert cfg.experts_per_token * aux == pytest.approx(float(theirs), rel=1e-5)


def test_the_selection_bias_moves_against_the_load():
  bias = update_bias(jnp.zeros((2, 4)), jnp.asarray([[5., 1., 1., 1.], [2., 2., 2., 2.]]), 1e-3)
  np.testing.assert_allclose(bias, [[-1e-3, 1e-3, 1e-3, 1e-3], [0, 0, 0, 0]])
  # and it only chooses: the weights stay the unbiased scores.
  cfg = MoEConfig(num_experts=4, experts_per_token=1, normalize_top_k=False, aux_loss_coef=0.0)
  moe = layer(cfg)
  x, _ = inputs()
  moe.bias_E[...] = jnp.asarray([0.0, 0.0, 0.0, 10.0])  # every token now picks expert 3
  y, stats = moe.forward(x)
  np.testing.assert_array_equal(stats.load_E, [0, 0, 0, x.shape[0] * x.shape[1]])
  ref_y, _ = plain_moe(x, *weights_of(moe), cfg, bias_E=moe.bias_E[...])
  np.testing.assert_allclose(y, ref_y, rtol=1e-5, atol=1e-6)


MESHES = {
    "fsdp=8": (dict(fsdp=8), ("fsdp",)),
    "data=2 fsdp=4": (dict(data=2, fsdp=4), ("fsdp",)),
    "expert_parallel=data,fsdp": (dict(data=2, fsdp=4), ("data", "fsdp")),
    "tensor=2 fsdp=4": (dict(fsdp=4, tensor=2), ("fsdp",)),
    "sequence=2 fsdp=4": (dict(fsdp=4, sequence=2), ("fsdp",)),
    "no expert parallelism, data=8": (dict(data=8), ()),
}


@pytest.mark.parametrize("gemm", experts.GEMMS)
@pytest.mark.parametrize("name", MESHES)
def test_experts_split_over_mesh_axes_equal_the_plain_loop(name, gemm):
  assert_split_experts_equal_the_plain_loop(name, gemm)


def assert_split_experts_equal_the_plain_loop(name, gemm="tiled", dispatch="padded"):
  """Values, gradients, switch loss and loads of the layer on `MESHES[name]`."""
  sizes, axes = MESHES[name]
  mesh = mesh_of(**sizes)
  cfg = CONFIGS["softmax top-2 of 8"]
  moe = layer(cfg, functools.partial(experts.expert_parallel, axes=axes, gemm=gemm,
                                     dispatch=dispatch))
  x, cotangent = inputs(batch=8, length=8)
  rules = r.strategy_rules(mesh, expert_axes=axes)
  with jax.set_mesh(mesh), nnx.logical_axis_rules(rules.params):
    tokens = NamedSharding(mesh, r.logical_to_spec((r.BATCH, r.LENGTH), rules.params))
    y, stats, grads = jax.jit(lambda x, c: layer_value_and_grads(moe, x, c))(
        jax.device_put(x, tokens), jax.device_put(cotangent, tokens))
  ref_y, ref_grads = plain_value_and_grads(moe, x, cotangent, cfg)
  assert_close(y, ref_y)
  assert_close(grads, ref_grads)
  _, one_device_stats, _ = layer_value_and_grads(moe, x, cotangent)
  np.testing.assert_allclose(float(stats.aux_loss), float(one_device_stats.aux_loss), rtol=1e-6)
  np.testing.assert_array_equal(stats.load_E, one_device_stats.load_E)


# Training: every composition equals the same model trained on one device.
MOE = {"model.moe.num_experts": 8, "model.moe.experts_per_token": 2, "model.moe.mlp_dim": 32,
       "model.moe.aux_loss_coef": 0.0}  # the switch loss's gradient: tested layer by layer above

# Pairwise, not a full product: each case composes several strategies and
# features, and `COMPOSITION_PAIRS` (checked below; `python tests/pairs.py`
# draws the table) names the pairs they must cover between them.
COMPOSITIONS = {
    "expert_parallel=data,fsdp accumulate 2": dict(mesh=dict(data=2, fsdp=4),
                                                   expert_parallel="data,fsdp", grad_accum_steps=2),
    "data=2 fsdp=4 zero1 accumulate 2": dict(mesh=dict(data=2, fsdp=4), zero_stage=1,
                                             grad_accum_steps=2),
    "data=2 fsdp=4 zero2 remat=full": dict(mesh=dict(data=2, fsdp=4), zero_stage=2, remat="full"),
    "data=2 fsdp=4 zero3 remat=selective": dict(mesh=dict(data=2, fsdp=4), zero_stage=3,
                                                remat="selective"),
    "tensor=2 fsdp=4": dict(mesh=dict(data=1, fsdp=4, tensor=2)),
    "tensor=2 fsdp=4 sequence parallel capacity 1.25": dict(
        mesh=dict(data=1, fsdp=4, tensor=2), tensor_sequence_parallel=True,
        model=dict(moe=dict(capacity_factor=1.25))),
    "sequence=2 fsdp=4 ulysses remat=full": dict(mesh=dict(data=1, fsdp=4, sequence=2),
                                                 attention=dict(sequence_strategy="ulysses"),
                                                 remat="full"),
    **{f"sequence=2 fsdp=4 {s} capacity 1": dict(
        mesh=dict(data=1, fsdp=4, sequence=2), attention=dict(sequence_strategy=s),
        model=dict(moe=dict(capacity_factor=1.0))) for s in ("all_gather_kv", "ring")},
    "data=8 accumulate 2 (experts replicated)": dict(mesh=dict(data=8), grad_accum_steps=2,
                                                     expert_parallel=""),
    "fsdp=8 ragged_dot grouped GEMM": dict(mesh=dict(data=1, fsdp=8),
                                           experts=dict(grouped_gemm="ragged_dot")),
    "fsdp=8 shared expert, first layer dense, sigmoid, best 2 of 4 groups": dict(
        mesh=dict(data=1, fsdp=8), model=dict(moe=dict(shared_mlp_dim=32, first_dense_layers=1,
                                                       router="sigmoid", route_scale=2.5,
                                                       expert_groups=4, groups_per_token=2))),
    # The switch loss's counts span every device that splits the tokens (fsdp,
    # and tensor under Megatron-SP), so its gradient is one device's.
    "tensor=2 fsdp=4 sequence parallel, sigmoid switch loss": dict(
        mesh=dict(data=1, fsdp=4, tensor=2), tensor_sequence_parallel=True,
        model=dict(moe=dict(router="sigmoid", aux_loss_coef=1.0))),
    "fsdp=4 tensor=2 gated shared expert (Qwen2-MoE) remat=selective": dict(
        mesh=dict(data=1, fsdp=4, tensor=2), tensor_sequence_parallel=True, remat="selective",
        model=dict(moe=dict(shared_mlp_dim=32, shared_gate=True, normalize_top_k=False))),
}


# Every pair the compositions covered when each was a case of its own (0e6941b).
COMPOSITION_PAIRS = pairs.parse("""
    accumulate: data, experts over fsdp, experts whole, fsdp, moe
    all_gather_kv: capacity, experts over fsdp, fsdp, moe, sequence
    capacity: experts over fsdp, fsdp, megatron-sp, moe, ring, sequence, tensor
    data: experts over data+fsdp, experts over fsdp, experts whole, fsdp, moe, zero1, zero2, zero3
    experts over data+fsdp: fsdp, moe
    experts over fsdp: first dense, fsdp, groups, megatron-sp, moe, ragged_dot, remat full, remat selective, ring, sequence, shared expert, shared gate, sigmoid, switch loss, tensor, ulysses, zero1, zero2, zero3
    experts whole: moe
    first dense: fsdp, groups, moe, shared expert, sigmoid
    fsdp: groups, megatron-sp, moe, ragged_dot, remat full, remat selective, ring, sequence, shared expert, shared gate, sigmoid, switch loss, tensor, ulysses, zero1, zero2, zero3
    groups: moe, shared expert, sigmoid
    megatron-sp: moe, shared expert, shared gate, sigmoid, switch loss, tensor
    moe: ragged_dot, remat full, remat selective, ring, sequence, shared expert, shared gate, sigmoid, switch loss, tensor, ulysses, zero1, zero2, zero3
    ring: sequence
    sequence: ulysses
    shared expert: shared gate, sigmoid, tensor
    shared gate: tensor
    sigmoid: switch loss, tensor
    switch loss: tensor
""")


def composed(changes):
  cfg = micro_config(**MOE)
  cfg.update(changes)
  return cfg


def composition_labels():
  return {case: pairs.labels(composed(changes)) for case, changes in COMPOSITIONS.items()}


def pipelined_labels():
  return {case: pairs.labels(composed(changes)) for case, changes in PIPELINED.items()}


def test_the_compositions_cover_every_pair_they_must():
  """Merging or removing a case below must not leave a pair of strategies
  and features uncomposed (`python tests/pairs.py` draws the tables)."""
  assert pairs.missing(composition_labels().values(), COMPOSITION_PAIRS) == []
  assert pairs.missing(pipelined_labels().values(), PIPELINED_PAIRS) == []


@pytest.mark.parametrize("case", tiered(COMPOSITIONS, ("expert_parallel=data,fsdp accumulate 2",
                                                       "fsdp=8 ragged_dot grouped GEMM",
                                                       "fsdp=8 shared expert, first layer dense, "
                                                       "sigmoid, best 2 of 4 groups")))
def test_moe_training_matches_unsharded_plain_jit(case):
  cfg = composed(COMPOSITIONS[case])
  batches = random_batches(STEPS, cfg.global_batch, cfg.seq_len, cfg.model.vocab_size)
  assert_matches_one_device(cfg, batches)


def half_precision_losses(working):
  """The losses of STEPS steps on fsdp=8 with the switch loss, weights and
  compute in `working`; asserts that no step overflowed."""
  batches = random_batches(STEPS, 16, 16, 64)
  cfg = micro_config(**{**MOE, "mesh.data": 1, "mesh.fsdp": 8, "param_dtype": working,
                        "compute_dtype": working, "model.moe.aux_loss_coef": 0.01})
  setup = build(cfg)
  state = setup.init_state()
  losses = []
  for batch in batches:
    state, metrics = setup.train_step(state, jax.device_put(batch,
                                                            setup.train_step.batch_sharding))
    losses.append(float(metrics["loss"]))
  assert int(metrics["nonfinite_steps"]) == 0
  return losses


@pytest.fixture(scope="module")
def float32_losses():
  """The float32 run both half precisions are compared with, trained once."""
  return half_precision_losses("float32")


@pytest.mark.parametrize("dtype", tiered(["bfloat16", "float16"], ("bfloat16",)))
def test_moe_in_half_precision_tracks_float32(dtype, float32_losses):
  """bfloat16, and float16 with loss scaling, on fsdp=8 with the switch loss:
  the losses stay within rounding of the float32 run (which equals one
  device above), and no step overflows."""
  np.testing.assert_allclose(half_precision_losses(dtype), float32_losses, atol=0.03)


@pytest.mark.parametrize("preset, total, active, lookup", [
    ("mixtral_8x7b", 46.7e9, 12.9e9, True), ("qwen3_30b_a3b", 30.5e9, 3.3e9, True),
    ("qwen1_5_moe_a2_7b", 14.3e9, 2.7e9, True), ("deepseek_v3", 671e9, 37e9, False),
    ("deepseek_v2_lite", 15.7e9, 2.4e9, False)])
def test_the_moe_presets_have_their_published_total_and_active_parameters(preset, total, active,
                                                                          lookup):
  """The model cards' counts, within 2.5% (they give two or three digits;
  Qwen3-30B-A3B's 3.3B active is 3.35B counted, V2-Lite's 2.4B 2.45B), Qwen1.5-MoE-A2.7B's gated
  shared expert and q/k/v biases included, DeepSeek's latent attention too.
  DeepSeek's active counts leave out the input embedding (a lookup, not a
  matmul: V2-Lite's 2.4B is 2.66B with it, 2.45B without), and DeepSeek-V3's
  leave out its multi-token prediction module: with it, and the copies of
  the embedding and the head its checkpoint holds, the card's total is 685B."""
  cfg = load(REPO / "configs" / f"{preset}.py")
  with_modules = plan(cfg, 64, False)["parameters"] if cfg.model.mtp_layers else None
  cfg.model.mtp_layers = 0
  report = plan(cfg, 64, False)
  embedding = cfg.model.vocab_size * cfg.model.embed_dim
  assert report["parameters"] == pytest.approx(total, rel=0.025)
  assert report["active_parameters"] - (not lookup) * embedding == pytest.approx(active,
                                                                                 rel=0.025)
  if with_modules:
    assert with_modules + 2 * embedding == pytest.approx(685e9, rel=0.005)


def test_expert_parallel_step_moves_tokens_by_all_to_all_as_planned_and_gathers_no_expert():
  """Read from the compiled step of fsdp=8: the experts stay where they lie
  (no all-gather has an expert weight's shape), the tokens travel by
  all-to-all over `fsdp`, and `meshtrain plan` counts those bytes."""
  cfg = micro_config(**MOE, **{"mesh.data": 1, "mesh.fsdp": 8})
  setup = build(cfg)
  compiled = compile_step(setup)
  e, d, f = 8, cfg.model.embed_dim, cfg.model.moe.mlp_dim
  module = hlo._parse_module(compiled.as_text())
  gathered = [i.shape for i in module.instructions() if i.opcode.startswith("all-gather")]
  assert not [s for s in gathered if f"{e},{d},{f}" in s or f"{e},{f},{d}" in s], gathered
  # Nor every token's router scores (XLA's partitioner gathers them for a top_k).
  assert not [s for s in gathered if f"[{cfg.global_batch},{cfg.seq_len},{e}]" in s], gathered
  measured = step_collectives(compiled, setup.mesh)
  planned = {(c["kind"], c["axis"]): c for c in plan(cfg, 8, False)["collectives"]}
  assert measured["all-to-all", "fsdp"]["bytes"] == pytest.approx(
      planned["all-to-all", "fsdp"]["bytes"], rel=0.02)
  assert measured["all-to-all", "fsdp"]["count"] == planned["all-to-all", "fsdp"]["count"]


# (mesh, config.expert_parallel, remat) of the layer memory checks.
LAYER_MEMORY = {
    "fsdp=8, every expert on every device, remat none": (dict(data=1, fsdp=8), "", "none"),
    "data=8, every expert on every device, remat none": (dict(data=8), "", "none"),
    "fsdp=8, experts over fsdp, remat none": (dict(data=1, fsdp=8), "fsdp", "none"),
    "data=2 fsdp=4, experts over data,fsdp, remat selective": (dict(data=2, fsdp=4), "data,fsdp",
                                                              "selective"),
}


@pytest.mark.parametrize("case", tiered(LAYER_MEMORY, (
    "fsdp=8, every expert on every device, remat none",)))
def test_a_layer_of_experts_costs_the_compiled_step_what_plan_counts(case):
  """What two more MoE layers add to the compiled step's temporaries, per
  layer, against what they add to `plan`'s saved activations and float32
  gradients: the dispatch buffers, and, without recomputation, a copy of
  the layer's expert weights (gathered where `fsdp` stores them split,
  typed per device inside the dispatch where every device holds them),
  which the step keeps for the backward. 32 experts of 32 x 256 make the
  weights most of a layer's residuals."""
  mesh, expert_parallel, remat = LAYER_MEMORY[case]
  per_layer = {}
  for layers in (2, 4):
    cfg = micro_config(**{**MOE, "model.moe.num_experts": 32, "model.moe.mlp_dim": 256,
                          "model.num_layers": layers, "remat": remat,
                          "expert_parallel": expert_parallel})
    cfg.update(mesh=mesh)
    setup = build(cfg)
    planned = plan(cfg, 8, False)["analytic"]["memory_bytes"]
    per_layer[layers] = (planned["activations"] + planned["grads"],
                         hlo.memory_bytes(compile_step(setup))["temp"])
  (planned_2, temp_2), (planned_4, temp_4) = per_layer[2], per_layer[4]
  weights = 3 * 32 * 32 * 256 * 4 // (8 if expert_parallel else 1)  # float32, per device
  assert temp_4 - temp_2 > (2 * weights if remat == "none" else 0)
  assert temp_4 - temp_2 == pytest.approx(planned_4 - planned_2, rel=0.02)


# A capacity on a length split over `sequence`: (mesh, sequence strategy).
CAPACITY_ON_SPLIT_LENGTH = {"sequence=2 all_gather_kv": (dict(fsdp=4, sequence=2), "all_gather_kv"),
                            "sequence=4 ring": (dict(fsdp=2, sequence=4), "ring")}


@pytest.mark.parametrize("case", tiered(CAPACITY_ON_SPLIT_LENGTH, ("sequence=2 all_gather_kv",)))
def test_capacity_on_a_split_length_gathers_only_each_chunks_counts(case):
  """Read from the compiled step: with a capacity, the routing counts each
  expert's assignments in position order across the shards of the length
  (through the ring's zigzag too) by gathering each chunk's [E] counts, not
  the assignments (`sequence.count_before`); the all-gathers over `sequence`
  are attention's K/V (none under ring) and these counts, and `meshtrain
  plan` counts them to the byte."""
  mesh, strategy = CAPACITY_ON_SPLIT_LENGTH[case]
  cfg = micro_config(**MOE, **{"model.moe.capacity_factor": 1.25, "mesh.data": 1,
                               **{f"mesh.{axis}": size for axis, size in mesh.items()},
                               "attention.sequence_strategy": strategy})
  setup = build(cfg)
  measured = step_collectives(compile_step(setup), setup.mesh)
  planned = {(c["kind"], c["axis"]): c for c in plan(cfg, 8, False)["collectives"]}
  assert measured["all-gather", "sequence"]["bytes"] == planned["all-gather", "sequence"]["bytes"]


# (capacity factor, Megatron-SP, what each tensor device dispatches: `experts.tensor_split`)
TENSOR_DISPATCH = {
    "dropless": (0.0, False, "length"),
    "dropless, Megatron-SP": (0.0, True, "length"),
    "capacity 1": (1.0, False, "batch"),
    "capacity 1, Megatron-SP (the length re-split by all-to-all)": (1.0, True, "batch"),
}


@pytest.mark.parametrize("case", TENSOR_DISPATCH)
def test_tensor_devices_dispatching_their_share_equal_one_device(case):
  """On tensor=2 x fsdp=4 each tensor device routes and sends its share of
  the tokens (of the length dropless; of the batch with a capacity, where a
  share of the length would need buckets as big as the whole's): values,
  gradients and dropped counts equal the layer on one device, with a router
  skewed so that capacity drops."""
  assert_tensor_shares_equal_one_device(case)


def assert_tensor_shares_equal_one_device(case, dispatch="padded"):
  capacity_factor, sequence_parallel, split = TENSOR_DISPATCH[case]
  cfg = MoEConfig(num_experts=8, experts_per_token=2, capacity_factor=capacity_factor)
  x, cotangent = inputs(batch=8, length=8)
  assert experts.tensor_split(8 // 4, 8, 2, 2, 8 // 4, cfg.capacity(8)) == split
  sharded = layer(cfg, functools.partial(experts.expert_parallel, axes=("fsdp",),
                                         per_sequence=cfg.capacity(8), dispatch=dispatch))
  one_device = layer(cfg)
  for moe in (sharded, one_device):
    moe.router_DxE[...] = moe.router_DxE[...].at[:, 0].add(2.0)
  mesh = mesh_of(fsdp=4, tensor=2)
  rules = r.strategy_rules(mesh, tensor_sequence_parallel=sequence_parallel)
  with jax.set_mesh(mesh), nnx.logical_axis_rules(rules.params):
    tokens = NamedSharding(mesh, r.logical_to_spec((r.BATCH, r.RES_LENGTH), rules.params))
    y, stats, grads = jax.jit(lambda x, c: layer_value_and_grads(sharded, x, c))(
        jax.device_put(x, tokens), jax.device_put(cotangent, tokens))
  ref_y, ref_stats, ref_grads = layer_value_and_grads(one_device, x, cotangent)
  assert_close(y, ref_y)
  assert_close(grads, ref_grads)
  assert float(stats.dropped) == float(ref_stats.dropped)
  assert (float(stats.dropped) > 0) == (capacity_factor > 0)


@functools.cache
def data_fsdp_all_to_all_bytes(capacity_factor):
  """The all-to-all bytes over `fsdp` of the compiled step of data=2 x fsdp=4
  (the tokens a device of tensor=2 x fsdp=4 holds): compiled once for the
  cases of a capacity factor."""
  setup = build(micro_config(**MOE, **{"model.moe.capacity_factor": capacity_factor,
                                       "mesh.data": 2, "mesh.fsdp": 4}))
  return step_collectives(compile_step(setup), setup.mesh)["all-to-all", "fsdp"]["bytes"]


# The compiled step of tensor=2 x fsdp=4: (capacity factor, Megatron-SP).
TENSOR_STEP = {"tp": (0.0, False), "megatron-sp": (0.0, True),
               "megatron-sp, capacity 1.25": (1.25, True)}


@pytest.mark.parametrize("case", tiered(TENSOR_STEP, ("tp",)))
def test_tensor_devices_dispatch_their_share_of_the_tokens(case):
  """Read from the compiled step of tensor=2 x fsdp=4: each tensor device
  sends its half of the tokens, so the all-to-all moves what a device of
  data=2 x fsdp=4 moves (same tokens per device), not twice that; the rows
  that arrive are gathered over `tensor` for the experts' halves and the
  outputs reduce-scattered back (with a capacity under Megatron-SP, a share
  of the batch taken from the length's split by all-to-alls over `tensor`),
  and `meshtrain plan` counts these bytes, to the byte."""
  capacity_factor, sequence_parallel = TENSOR_STEP[case]
  moe = {**MOE, "model.moe.capacity_factor": capacity_factor}
  cfg = micro_config(**moe, **{"mesh.data": 1, "mesh.fsdp": 4, "mesh.tensor": 2,
                               "tensor_sequence_parallel": sequence_parallel})
  setup = build(cfg)
  measured = step_collectives(compile_step(setup), setup.mesh)
  same_tokens = data_fsdp_all_to_all_bytes(capacity_factor)
  assert measured["all-to-all", "fsdp"]["bytes"] == same_tokens
  planned = {(c["kind"], c["axis"]): c for c in plan(cfg, 8, False)["collectives"]}
  checked = [("all-to-all", "fsdp"), ("all-gather", "tensor"), ("reduce-scatter", "tensor"),
             *([("all-to-all", "tensor")] if capacity_factor else [])]
  for key in checked:
    assert measured[key]["bytes"] == planned[key]["bytes"], key


def test_experts_in_the_pipeline_stay_split_and_take_tokens_by_all_to_all():
  """Read from the compiled step of pipeline=2 x fsdp=2 x tensor=2 (1F1B): in
  the stages' work the tokens reach the experts by all-to-all over `fsdp`, no
  all-gather holds every expert, and the only collective-permutes are the
  pipeline's own (one over other axes inside a stage's conditional would wait
  on XLA:CPU for devices of the other stage)."""
  cfg = micro_config(**MOE, **{"mesh.data": 1, "mesh.pipeline": 2, "mesh.fsdp": 2,
                               "mesh.tensor": 2})
  setup = build(cfg)
  compiled = compile_step(setup)
  e, d, f = 8, cfg.model.embed_dim, cfg.model.moe.mlp_dim // 2
  module = hlo._parse_module(compiled.as_text())
  gathered = [i.shape for i in module.instructions() if i.opcode.startswith("all-gather")]
  assert not [s for s in gathered if f"{e},{d},{f}" in s or f"{e},{f},{d}" in s], gathered
  collectives = hlo.collectives(compiled, setup.mesh)
  assert {c.axis for c in collectives if c.kind == "all-to-all"} == {"fsdp"}
  assert {c.axis for c in collectives if c.kind == "collective-permute"} == {"pipeline"}


def moe_run_config(workdir, **changes):
  return micro_config(**{**MOE, "model.moe.aux_loss_coef": 0.01,
                         "model.moe.bias_update_rate": 1e-2, "workdir": str(workdir), "steps": 6,
                         "log_every": 1, "checkpoint.every_steps": 3, "mesh.data": 1,
                         "mesh.fsdp": 8, **changes})


@pytest.mark.slow
def test_training_logs_balance_moves_the_bias_and_resumes_bit_exactly(tmp_path):
  """metrics.jsonl has the MoE metrics every step; the selection bias moves
  by the rate each step (the same on every device: it is replicated), lies in
  the checkpoint, and a resume from step 3 gives the same losses and bias;
  a restore onto another expert layout (data=2 x fsdp=4, experts over both)
  continues within float32 rounding."""
  straight = train(moe_run_config(tmp_path / "straight"))
  logged = [json.loads(line) for line in (tmp_path / "straight/metrics.jsonl").read_text().splitlines()]
  for record in logged:
    assert {"moe_aux_loss", "moe_load_max_over_mean", "moe_dropped_fraction"} <= record.keys()
    assert record["moe_dropped_fraction"] == 0 and record["moe_load_max_over_mean"] >= 1
  setup = build(moe_run_config(tmp_path / "straight"))
  bias = load_model_state(tmp_path / "straight", 6, jax.eval_shape(setup.spec.init_model_state),
                          setup.shardings.model_state)["layers"]["mlp"]["bias_E"]
  steps = np.round(np.asarray(bias) / 1e-2)
  assert np.abs(steps).max() > 0 and np.allclose(steps * 1e-2, bias)  # moved by the rate
  restore = str(tmp_path / "straight/checkpoints/3")
  resumed = train(moe_run_config(tmp_path / "resumed", **{"checkpoint.restore_from": restore}))
  pick = lambda records: [(r["step"], r["loss"], r["moe_load_max_over_mean"])  # noqa: E731
                          for r in records if r["step"] > 3]
  assert pick(resumed) == pick(straight)
  other = train(moe_run_config(tmp_path / "other", **{"checkpoint.restore_from": restore,
                                                      "mesh.data": 2, "mesh.fsdp": 4,
                                                      "expert_parallel": "data,fsdp"}))
  np.testing.assert_allclose([r["loss"] for r in other if r["step"] > 3],
                             [r["loss"] for r in straight if r["step"] > 3], rtol=1e-5)


PIPELINED = {
    "pipeline=2 fsdp=4 zb_h1": dict(mesh=dict(data=1, pipeline=2, fsdp=4),
                                    pipeline=dict(schedule="zb_h1")),
    "pipeline=2 fsdp=4 gpipe": dict(mesh=dict(data=1, pipeline=2, fsdp=4),
                                    pipeline=dict(schedule="gpipe")),
    "pipeline=2 fsdp=2 tensor=2 zb_h2": dict(mesh=dict(data=1, pipeline=2, fsdp=2, tensor=2),
                                             pipeline=dict(schedule="zb_h2")),
    "pipeline=2 fsdp=2 tensor=2 experts whole": dict(mesh=dict(data=1, pipeline=2, fsdp=2,
                                                               tensor=2), expert_parallel=""),
    "pipeline=2 fsdp=2 sequence=2 ulysses": dict(mesh=dict(data=1, pipeline=2, fsdp=2, sequence=2),
                                                 attention=dict(sequence_strategy="ulysses")),
    "pipeline=2 fsdp=2 sequence=2 capacity 1": dict(
        mesh=dict(data=1, pipeline=2, fsdp=2, sequence=2),
        model=dict(moe=dict(capacity_factor=1.0))),
    "pipeline=2 data=2 fsdp=2 interleaved, first layer dense": dict(
        mesh=dict(data=2, pipeline=2, fsdp=2), model=dict(
            num_layers=5, moe=dict(first_dense_layers=1)),
        pipeline=dict(schedule="interleaved_1f1b", virtual_stages=2, microbatches=2)),
    "pipeline=2 data=2 tensor=2 accumulate 2, switch loss": dict(
        mesh=dict(data=2, pipeline=2, tensor=2), grad_accum_steps=2,
        pipeline=dict(microbatches=2), model=dict(moe=dict(aux_loss_coef=0.01))),
    "pipeline=2 fsdp=4 uneven stages, bias balancing, switch loss": dict(
        mesh=dict(data=1, pipeline=2, fsdp=4),
        pipeline=dict(stage_layers="3,1"), model=dict(num_layers=4, moe=dict(
            aux_loss_coef=0.01, bias_update_rate=0.01)))}


# Every pair the pipelined cases covered when each was a case of its own (0e6941b).
PIPELINED_PAIRS = pairs.parse("""
    1f1b: accumulate, all_gather_kv, bias balancing, capacity, data, experts over fsdp, experts whole, fsdp, moe, pipeline, sequence, switch loss, tensor, ulysses, uneven stages
    accumulate: data, experts whole, moe, pipeline, switch loss, tensor
    all_gather_kv: capacity, experts over fsdp, fsdp, moe, pipeline, sequence
    bias balancing: experts over fsdp, fsdp, moe, pipeline, switch loss, uneven stages
    capacity: experts over fsdp, fsdp, moe, pipeline, sequence
    data: experts over fsdp, experts whole, first dense, fsdp, interleaved_1f1b, moe, pipeline, switch loss, tensor
    experts over fsdp: first dense, fsdp, gpipe, interleaved_1f1b, moe, pipeline, sequence, switch loss, tensor, ulysses, uneven stages, zb_h1, zb_h2
    experts whole: fsdp, moe, pipeline, switch loss, tensor
    first dense: fsdp, interleaved_1f1b, moe, pipeline
    fsdp: gpipe, interleaved_1f1b, moe, pipeline, sequence, switch loss, tensor, ulysses, uneven stages, zb_h1, zb_h2
    gpipe: moe, pipeline
    interleaved_1f1b: moe, pipeline
    moe: pipeline, sequence, switch loss, tensor, ulysses, uneven stages, zb_h1, zb_h2
    pipeline: sequence, switch loss, tensor, ulysses, uneven stages, zb_h1, zb_h2
    sequence: ulysses
    switch loss: tensor, uneven stages
""")


@pytest.mark.parametrize("case", tiered(PIPELINED, ("pipeline=2 fsdp=4 zb_h1",)))
def test_moe_in_the_pipeline_matches_the_step_without_it(case):
  """The pipeline's MoE layers equal one device; with the switch loss on, and
  its counts, they equal the step without the pipeline over the same
  microbatches (the loss's gradient against a plain loop is the layer
  tests' subject)."""
  cfg = composed(PIPELINED[case])
  batches = random_batches(STEPS, cfg.global_batch, cfg.seq_len, cfg.model.vocab_size)
  if cfg.model.moe.aux_loss_coef:
    *_, params, logged = meshtrain_run(cfg, batches, with_metrics=True)
  else:
    *_, params, logged = assert_matches_one_device(cfg, batches, with_metrics=True)
  # Without the pipeline, accumulating over the same microbatches: a switch
  # loss is a function of the tokens one forward routes.
  flat = cfg.copy_and_resolve_references()
  flat.mesh.pipeline, flat.pipeline.stage_layers = 1, ""
  flat.grad_accum_steps *= cfg.pipeline.microbatches
  *_, flat_params, flat_logged = meshtrain_run(flat, batches, with_metrics=True,
                                               devices=jax.devices()[:8 // cfg.mesh.pipeline])
  for got, want in zip(logged, flat_logged):
    for key in ("loss", "moe_aux_loss", "moe_load_max_over_mean"):
      assert got[key] == pytest.approx(want[key], rel=1e-5), key
  chex.assert_trees_all_close(params, flat_params, rtol=1e-5,
                              atol=1e-3 * cfg.optimizer.learning_rate)
