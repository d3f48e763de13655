"""The Mixture-of-Experts MLP: a router in float32 choosing k of E SwiGLU
experts for each token, an optional dense shared expert beside them (its
output gated per token by sigmoid(x . w) where `shared_gate`, as Qwen2-MoE's),
and the balancing of the experts' load.

Routing: scores are the softmax (Mixtral, Qwen) or the sigmoid (DeepSeek-V3)
of the router's logits. The k experts are those with the highest score plus a
selection-only bias (DeepSeek-V3's auxiliary-loss-free balancing; zero
otherwise), with `groups_per_token` > 0 among the experts of the token's that
many best of `expert_groups` groups (`in_best_groups`, DeepSeek-V3's 4 of 8,
a group scored by the sum of its `group_scored_by` best experts' scores: 2
in DeepSeek-V3, 1 in DeepSeek-V2);
the token's weights are their unbiased scores, renormalised to sum to 1 where
`normalize_top_k`, times `route_scale`. With a `capacity_factor` c > 0, an
expert takes at most ceil(c x L x k / E) of a sequence's assignments, first
come (by position, then by rank) first served; the rest are dropped (weight
0). How the kept assignments reach their experts, on this device or across
the expert-parallel axes, is the model's `experts` slot
(`meshtrain.parallel.experts`).

Balance, in every MoE layer:
  switch loss   E x sum_e f_e x P_e, with f_e the share of the batch's k x T
                assignments that chose expert e and P_e the mean over tokens
                of its normalised score: 1.0 for a perfectly balanced router
                (Hugging Face's `load_balancing_loss_func` is k times this).
                The step's loss weighs it `aux_loss_coef` / (MoE layers):
                its gradient is added to the scores' in the backward
                (`with_aux_gradient`, Megatron's MoEAuxLossAutoScaler), so no
                layer has to hand a second loss up to the head.
  bias          the per-expert selection bias, model state rather than a
                weight: after each step it moves by
                `bias_update_rate` x sign(mean load - load) (`update_bias`).
Counts (load, tokens, dropped) are sums over every token of the batch, by the
model's `token_sum` slot, so they are the same on every mesh.
"""

import dataclasses
import math
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from meshtrain import rules as r
from meshtrain.models.layers import MLP, MLP_OUT, param, weight_matmul
from meshtrain.parallel import experts as experts_kernels, sequence

ROUTERS = ("softmax", "sigmoid")
ROUTER_STD = 0.02


@dataclasses.dataclass(frozen=True)
class MoEConfig:
  num_experts: int = 0  # 0: the dense MLP
  experts_per_token: int = 2
  mlp_dim: int = 0  # each expert's hidden width; 0: the model's mlp_dim
  shared_mlp_dim: int = 0
  shared_gate: bool = False
  expert_groups: int = 1
  groups_per_token: int = 0  # 0: every group
  group_scored_by: int = 2  # a group's score: the sum of its this many best experts' scores
  first_dense_layers: int = 0
  router: str = "softmax"
  normalize_top_k: bool = True
  route_scale: float = 1.0
  aux_loss_coef: float = 0.01
  bias_update_rate: float = 0.0
  capacity_factor: float = 0.0

  def capacity(self, length: int) -> int:
    """Assignments an expert takes from one sequence of `length` tokens (0: all);
    at most `length`, as many as it can get (a token picks an expert once)."""
    if not self.capacity_factor:
      return 0
    return math.ceil(min(length, self.capacity_factor * length * self.experts_per_token /
                         self.num_experts))


class Routing(NamedTuple):
  expert_BxLxK: jax.Array  # int32, -1 where the assignment was dropped
  weight_BxLxK: jax.Array  # float32, 0 where dropped


class Stats(NamedTuple):
  """A layer's routing counts, sums over every token of the batch (and, over
  a step's forwards, sums again: `forwards` counts them)."""
  load_E: jax.Array     # assignments that chose each expert (before capacity)
  tokens: jax.Array     # tokens routed
  dropped: jax.Array    # assignments dropped by capacity
  aux_loss: jax.Array   # the switch loss (a value; its gradient is injected)
  forwards: jax.Array   # 1 per forward


# (x_BxLxE) -> (per token, the sum of x over the earlier positions of its
# sequence; the sequence's length): `meshtrain.parallel.sequence.count_before`.
CountBefore = Callable[[jax.Array], tuple[jax.Array, int]]


def _plain_sum(x: jax.Array) -> jax.Array:
  """Sum over the leading [batch, length] dimensions."""
  return x.sum(axis=(0, 1))


@jax.custom_vjp
def with_aux_gradient(scores_BxLxE: jax.Array, grad_BxLxE: jax.Array) -> jax.Array:
  """`scores` unchanged; in the backward, `grad` is added to its cotangent (the
  gradient of an auxiliary loss that is not part of the forward's output)."""
  return scores_BxLxE


def _with_aux_fwd(scores_BxLxE, grad_BxLxE):
  return scores_BxLxE, grad_BxLxE


def _with_aux_bwd(grad_BxLxE, cotangent_BxLxE):
  return cotangent_BxLxE + grad_BxLxE, jnp.zeros_like(grad_BxLxE)


with_aux_gradient.defvjp(_with_aux_fwd, _with_aux_bwd)


def _normalized(scores_BxLxE: jax.Array) -> jax.Array:
  """Each token's scores over their sum: the probabilities of the switch loss."""
  return scores_BxLxE / scores_BxLxE.sum(axis=-1, keepdims=True)


def top_k_indices(x_BxLxE: jax.Array, k: int) -> jax.Array:
  """`lax.top_k(x, k)[1]` (the highest first, the lower index on a tie), as k
  argmaxes: reductions over E that XLA partitions along the tokens, where its
  partitioner gathers every token's scores to each device for a top_k."""
  chosen = []
  for _ in range(k):
    chosen.append(jnp.argmax(x_BxLxE, axis=-1).astype(jnp.int32))
    x_BxLxE = jnp.where(jax.nn.one_hot(chosen[-1], x_BxLxE.shape[-1], dtype=bool), -jnp.inf,
                        x_BxLxE)
  return jnp.stack(chosen, axis=-1)


def in_best_groups(choice_BxLxE: jax.Array, groups: int, chosen: int,
                   scored_by: int = 2) -> jax.Array:
  """`choice` with the experts outside each token's `chosen` best of `groups`
  equal groups set to -inf: DeepSeek's node-limited routing, a group's score
  the sum of its `scored_by` highest (DeepSeek-V3: two; V2: one; at most the
  group's size)."""
  *lead, num_experts = choice_BxLxE.shape
  choice_BxLxGxS = choice_BxLxE.reshape(*lead, groups, num_experts // groups)
  best_BxLxGxT = top_k_indices(choice_BxLxGxS, min(scored_by, num_experts // groups))
  score_BxLxG = jnp.take_along_axis(choice_BxLxGxS, best_BxLxGxT, axis=-1).sum(axis=-1)
  kept_BxLxG = jax.nn.one_hot(top_k_indices(score_BxLxG, chosen), groups, dtype=bool).any(axis=-2)
  return jnp.where(kept_BxLxG[..., None], choice_BxLxGxS, -jnp.inf).reshape(choice_BxLxE.shape)


def route(x_BxLxD: jax.Array, router_DxE: jax.Array, bias_E: jax.Array, cfg: MoEConfig,
          token_sum: Callable[[jax.Array], jax.Array] = _plain_sum,
          aux_weight: float = 1.0,
          count_before: CountBefore = sequence.count_before) -> tuple[Routing, Stats]:
  """The k experts and weights of every token, and the layer's counts.
  `aux_weight` is the step loss's weight of this layer's switch loss;
  `count_before` counts, for the capacity, what each expert got earlier in a
  token's sequence (a token chooses an expert once, so its rank among the
  expert's assignments is that count)."""
  k, num_experts = cfg.experts_per_token, cfg.num_experts
  # The router whole on each device (an all-gather of D x E): else XLA may
  # reshard it by a collective-permute over every device, which inside a
  # pipeline stage's conditional waits on XLA:CPU for stages that never come.
  logits_BxLxE = jnp.einsum("bld,de->ble", x_BxLxD.astype(jnp.float32),
                            r.constrain(router_DxE.astype(jnp.float32), (None, None)))
  scores_BxLxE = (jax.nn.softmax(logits_BxLxE, axis=-1) if cfg.router == "softmax"
                  else jax.nn.sigmoid(logits_BxLxE))
  # The choice and the switch loss read the scores without gradient: the
  # loss reaches the router through `with_aux_gradient` below.
  fixed_scores_BxLxE = jax.lax.stop_gradient(scores_BxLxE)
  probs_BxLxE = _normalized(fixed_scores_BxLxE)  # softmax: unchanged
  choice_BxLxE = fixed_scores_BxLxE + bias_E
  if cfg.groups_per_token:
    choice_BxLxE = in_best_groups(choice_BxLxE, cfg.expert_groups, cfg.groups_per_token,
                                  cfg.group_scored_by)
  expert_BxLxK = top_k_indices(choice_BxLxE, k)
  chosen_BxLxE = jax.nn.one_hot(expert_BxLxK, num_experts, dtype=jnp.float32).sum(axis=2)
  tokens = token_sum(jnp.ones(x_BxLxD.shape[:2] + (1,), jnp.float32))[0]
  load_E = token_sum(chosen_BxLxE)
  share_E = load_E / (k * tokens)
  aux_loss = num_experts * jnp.sum(share_E * token_sum(probs_BxLxE) / tokens)
  if aux_weight and cfg.aux_loss_coef:  # d(weight x loss)/d(probs) of each token
    grad_E = aux_weight * cfg.aux_loss_coef * num_experts * share_E / tokens
    # ... and through probs = scores / sum(scores) to the scores, which the
    # weights come from: (g - sum_e g_e probs_e) / sum(scores).
    grad_BxLxE = (grad_E - jnp.sum(grad_E * probs_BxLxE, axis=-1, keepdims=True)) / (
        fixed_scores_BxLxE.sum(axis=-1, keepdims=True))
    scores_BxLxE = with_aux_gradient(scores_BxLxE, grad_BxLxE)
  weights_source = _normalized(scores_BxLxE) if cfg.router == "softmax" else scores_BxLxE
  weight_BxLxK = jnp.take_along_axis(weights_source, expert_BxLxK, axis=-1)
  if cfg.normalize_top_k:
    weight_BxLxK = weight_BxLxK / weight_BxLxK.sum(axis=-1, keepdims=True)
  weight_BxLxK = weight_BxLxK * cfg.route_scale
  dropped = jnp.zeros((), jnp.float32)
  if cfg.capacity_factor:  # first come (by position) first served, per sequence and expert
    before_BxLxE, length = count_before(chosen_BxLxE.astype(jnp.int32))
    kept_BxLxK = (jnp.take_along_axis(before_BxLxE, expert_BxLxK, axis=-1)
                  < cfg.capacity(length))
    dropped = token_sum((~kept_BxLxK).astype(jnp.float32).sum(axis=-1, keepdims=True))[0]
    expert_BxLxK = jnp.where(kept_BxLxK, expert_BxLxK, -1)
    weight_BxLxK = jnp.where(kept_BxLxK, weight_BxLxK, 0.0)
  return (Routing(expert_BxLxK.astype(jnp.int32), weight_BxLxK),
          Stats(load_E, tokens, dropped, aux_loss, jnp.ones((), jnp.float32)))


def update_bias(bias_E: jax.Array, load_E: jax.Array, rate: float) -> jax.Array:
  """DeepSeek-V3's balancing step: experts above the mean load lose `rate`, below it gain it."""
  return bias_E + rate * jnp.sign(load_E.mean(axis=-1, keepdims=True) - load_E)


def metrics(stats: dict, k: int) -> dict[str, jax.Array]:
  """A step's MoE metrics from its layers' counts (fields of `Stats`, [L, ...]):
  the mean switch loss of a layer, the worst layer's busiest expert over its
  mean load, and the share of assignments dropped by capacity."""
  load_LxE = stats["load_E"]
  return {"moe_aux_loss": jnp.mean(stats["aux_loss"] / stats["forwards"]),
          "moe_load_max_over_mean": jnp.max(load_LxE.max(axis=-1) / load_LxE.mean(axis=-1)),
          "moe_dropped_fraction": stats["dropped"].sum() / (k * stats["tokens"].sum())}


# The routed experts' computation: (x_BxLxD, expert_BxLxK, weight_BxLxK,
# w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD, *, gemm) -> y_BxLxD, each token's
# weighted sum of its kept experts' outputs (`meshtrain.parallel.experts`).
ExpertsFn = Callable[..., jax.Array]


class MoE(nnx.Module):
  """Routed SwiGLU experts (and a shared one): `forward(x) -> (y, Stats)`."""

  def __init__(self, embed_dim: int, hidden_dim: int, cfg: MoEConfig, rngs: nnx.Rngs,
               experts: ExpertsFn = experts_kernels.grouped_experts,
               token_sum: Callable[[jax.Array], jax.Array] = _plain_sum, aux_weight: float = 1.0,
               count_before: CountBefore = sequence.count_before):
    d, e, f = embed_dim, cfg.num_experts, cfg.mlp_dim or hidden_dim
    self.cfg, self.experts, self.token_sum, self.aux_weight = cfg, experts, token_sum, aux_weight
    self.count_before = count_before
    # std 0.02, as Megatron and transformers draw routers: near-uniform scores at first.
    self.router_DxE = param(rngs, (d, e), (r.EMBED, None), fan_in=ROUTER_STD**-2)
    self.w_gate_ExDxF = param(rngs, (e, d, f), (r.EXPERTS, r.EMBED, r.EXPERT_MLP), d)
    self.w_up_ExDxF = param(rngs, (e, d, f), (r.EXPERTS, r.EMBED, r.EXPERT_MLP), d)
    self.w_down_ExFxD = param(rngs, (e, f, d), (r.EXPERTS, r.EXPERT_MLP, r.EMBED), f)
    self.bias_E = nnx.BatchStat(jnp.zeros((e,), jnp.float32), sharding_names=(None,),
                                eager_sharding=False)
    self.shared = MLP(d, cfg.shared_mlp_dim, rngs) if cfg.shared_mlp_dim else None
    # Qwen2-MoE's shared_expert_gate: a token's shared output times sigmoid(x . w).
    self.shared_gate_Dx1 = param(rngs, (d, 1), (r.EMBED, None), d) if cfg.shared_gate else None

  def forward(self, x_BxLxD: jax.Array) -> tuple[jax.Array, Stats]:
    routing, stats = route(x_BxLxD, self.router_DxE[...], self.bias_E[...], self.cfg,
                           self.token_sum, self.aux_weight, self.count_before)
    y_BxLxD = self.experts(x_BxLxD, routing.expert_BxLxK, routing.weight_BxLxK,
                           self.w_gate_ExDxF[...], self.w_up_ExDxF[...], self.w_down_ExFxD[...])
    if self.shared is not None:
      shared_BxLxD = self.shared(x_BxLxD)
      if self.shared_gate_Dx1 is not None:
        gate_BxLx1 = weight_matmul("bld,do->blo", x_BxLxD, self.shared_gate_Dx1[...])
        shared_BxLxD = shared_BxLxD * jax.nn.sigmoid(gate_BxLx1)
      y_BxLxD = y_BxLxD + shared_BxLxD
    y_BxLxD = r.constrain(y_BxLxD, (r.BATCH, r.RES_LENGTH, r.ACT_EMBED))
    return checkpoint_name(y_BxLxD, MLP_OUT), stats

  def __call__(self, x_BxLxD: jax.Array) -> jax.Array:
    return self.forward(x_BxLxD)[0]
