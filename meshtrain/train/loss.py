"""The training loss: the mean next-token loss over the tokens that count.

A target token does not count when it is padding (`segment_ids` 0, packed
documents) or when the batch's `loss_mask` leaves it out (0: the user and
system turns of a conversation, `meshtrain prepare --format chat`). The loss
is the mean over the counted tokens of the whole global batch, the same on
every mesh, with accumulation and in the pipeline: `with_loss_weights`
weighs each token once, on the whole batch, before anything splits it, with
weights that average 1 over the batch; the mean of `token loss x weight` over
any equal share of the batch (a microbatch, a replica's rows, one device's
tokens), averaged over the shares, is then that global mean.

Multi-token prediction (`model.mtp_layers` = K > 0, DeepSeek-V3) adds K more
means, one per depth k: of predicting the token k + 1 places after each
position, over the positions whose token that far ahead counts and lies in
the same document. `with_loss_weights` adds, on the whole batch, each
position's tokens k places ahead (`mtp_inputs`) and k + 1 places ahead
(`mtp_targets`) and their weights (`mtp_loss_weights`), all [B, L, K], so
the model shifts nothing along a length that may come split or reordered.
The training loss is the next-token mean plus `mtp_loss_coef` times the
mean of the K depths' (DeepSeek-V3's report, section 2.2).
"""

import functools

import jax
import jax.numpy as jnp


def cross_entropy(logits_BxLxV: jax.Array, targets_BxL: jax.Array,
                  weights_BxL: jax.Array | None = None) -> jax.Array:
  """Mean next-token loss that never gathers the vocabulary: the log-sum-exp
  and the target's logit are both reductions over `vocab`, so under vocabulary
  parallelism each device reduces its slice and all-reduces [batch, length].
  `weights_BxL` (`loss_weights`) weigh each token's loss in the mean."""
  loss_BxL = token_losses(logits_BxLxV, targets_BxL)
  return jnp.mean(loss_BxL if weights_BxL is None else loss_BxL * weights_BxL)


def token_losses(logits_BxLxV: jax.Array, targets_BxL: jax.Array) -> jax.Array:
  """Each token's next-token loss, [batch, length]."""
  target_logit_BxL = jnp.sum(
      logits_BxLxV * jax.nn.one_hot(targets_BxL, logits_BxLxV.shape[-1], dtype=logits_BxLxV.dtype),
      axis=-1)
  return jax.nn.logsumexp(logits_BxLxV, axis=-1) - target_logit_BxL


def counted_tokens(batch: dict) -> jax.Array | None:
  """Whether each target token counts (bool [B, L]); None when all do."""
  counted_BxL = None
  if "segment_ids" in batch:
    counted_BxL = batch["segment_ids"] != 0
  if "loss_mask" in batch:
    kept_BxL = batch["loss_mask"] != 0
    counted_BxL = kept_BxL if counted_BxL is None else counted_BxL & kept_BxL
  return counted_BxL


def loss_weights(batch: dict) -> jax.Array | None:
  """Each token's weight in the batch's mean loss (float32 [B, L]): 0 where it
  does not count, the counted ones equal and averaging 1 over the batch. A
  batch's own `loss_weights` (given to it before it was split) come first."""
  if "loss_weights" in batch:
    return batch["loss_weights"]
  counted_BxL = counted_tokens(batch)
  if counted_BxL is None:
    return None
  return _averaging_one(counted_BxL)


def _averaging_one(counted_BxL: jax.Array) -> jax.Array:
  """Weights of the counted tokens (bool [B, L]): equal, averaging 1 over the
  batch; 0 elsewhere."""
  counted_BxL = counted_BxL.astype(jnp.float32)
  return counted_BxL * (counted_BxL.size / jnp.maximum(counted_BxL.sum(), 1))


def _ahead(x_BxL: jax.Array, k: int, fill) -> jax.Array:
  """x k places ahead of each position, `fill` past the end."""
  return jnp.concatenate([x_BxL[:, k:], jnp.full_like(x_BxL[:, :k], fill)], axis=1)


def mtp_batch(batch: dict, depth: int) -> dict:
  """The multi-token prediction's [B, L, depth] arrays of the batch (module
  docstring), the weights of each depth averaging 1 over the batch."""
  tokens_BxL1 = jnp.concatenate([batch["inputs"], batch["targets"][:, -1:]], axis=1)
  counted_BxL = counted_tokens(batch)
  if counted_BxL is None:
    counted_BxL = jnp.ones(batch["targets"].shape, bool)
  inputs, targets, weights = [], [], []
  for k in range(1, depth + 1):
    inputs.append(_ahead(tokens_BxL1, k, 0)[:, :-1])
    targets.append(_ahead(batch["targets"], k, 0))
    counted_k_BxL = _ahead(counted_BxL, k, False)
    if "segment_ids" in batch:
      counted_k_BxL &= _ahead(batch["segment_ids"], k, 0) == batch["segment_ids"]
    weights.append(_averaging_one(counted_k_BxL))
  stack = functools.partial(jnp.stack, axis=-1)
  return {"mtp_inputs": stack(inputs).astype(batch["inputs"].dtype),
          "mtp_targets": stack(targets).astype(batch["targets"].dtype),
          "mtp_loss_weights": stack(weights)}


def with_loss_weights(batch: dict, mtp_depth: int = 0) -> dict:
  """`batch` with its `loss_weights`, where some tokens do not count, and with
  `mtp_depth` > 0 its multi-token prediction's (`mtp_batch`): called on the
  whole batch, before it is split into microbatches or replicas."""
  weights_BxL = loss_weights(batch)
  if weights_BxL is not None:
    batch = {**batch, "loss_weights": weights_BxL}
  return {**batch, **mtp_batch(batch, mtp_depth)} if mtp_depth else batch


def model_loss(model, batch: dict[str, jax.Array]) -> tuple[jax.Array, dict]:
  """The loss of `model.forward(inputs, segment_ids=..., positions=...)` on a
  batch (the mean over its counted tokens, or its `loss_weights`), and the
  counts the model reports (`Llama.forward`'s; {} for none). A batch with
  `mtp_inputs` (`with_loss_weights`) adds the multi-token prediction's loss
  (`Llama.forward_mtp`), and its per-depth sums to the counts:
  `mtp_loss_sum` (of each token's loss times its weight) and
  `mtp_weight_sum`, whose ratio over the step is each depth's mean loss."""
  args = dict(segment_ids=batch.get("segment_ids"), positions=batch.get("positions"))
  if "mtp_inputs" not in batch:
    logits_BxLxV, stats = model.forward(batch["inputs"], **args)
    return cross_entropy(logits_BxLxV, batch["targets"], loss_weights(batch)), stats or {}
  logits_BxLxV, mtp_logits, stats = model.forward_mtp(batch["inputs"], batch["mtp_inputs"],
                                                      **args)
  loss, sums = multi_token_loss(logits_BxLxV, mtp_logits, batch, model.cfg.mtp_loss_coef,
                                model.slots.token_sum)
  return loss, {**(stats or {}), **sums}


def multi_token_loss(logits_BxLxV: jax.Array, mtp_logits: list[jax.Array], batch: dict,
                     coef: float, token_sum) -> tuple[jax.Array, dict]:
  """The next-token loss plus `coef` x the mean of the depths' (`mtp_logits`,
  `mtp_batch`'s targets and weights), and the depths' counts: `mtp_loss_sum`
  (each token's loss times its weight) and `mtp_weight_sum`, summed by
  `token_sum` (`Slots.token_sum`: over every token of the batch), whose
  ratio over a step is each depth's mean loss."""
  loss = cross_entropy(logits_BxLxV, batch["targets"], loss_weights(batch))
  weights_BxLxK = batch["mtp_loss_weights"]
  losses_BxLxK = jnp.stack([token_losses(logits, batch["mtp_targets"][..., k])
                            for k, logits in enumerate(mtp_logits)], axis=-1)
  mtp_loss = jnp.mean(losses_BxLxK * weights_BxLxK)
  return (loss + coef * mtp_loss, {"mtp_loss_sum": token_sum(losses_BxLxK * weights_BxLxK),
                                   "mtp_weight_sum": token_sum(weights_BxLxK)})


def mtp_metrics(stats: dict) -> dict[str, jax.Array]:
  """`mtp_loss`: the step's mean multi-token prediction loss over its depths."""
  weights_K = stats["mtp_weight_sum"]
  return {"mtp_loss": jnp.mean(jnp.where(weights_K > 0, stats["mtp_loss_sum"], 0)
                               / jnp.maximum(weights_K, 1e-30))}
