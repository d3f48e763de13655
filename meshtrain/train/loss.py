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
"""

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
  counted_BxL = counted_BxL.astype(jnp.float32)
  return counted_BxL * (counted_BxL.size / jnp.maximum(counted_BxL.sum(), 1))


def with_loss_weights(batch: dict) -> dict:
  """`batch` with its `loss_weights`, where some tokens do not count: called on
  the whole batch, before it is split into microbatches or replicas."""
  weights_BxL = loss_weights(batch)
  return batch if weights_BxL is None else {**batch, "loss_weights": weights_BxL}


def model_loss(model, batch: dict[str, jax.Array]) -> tuple[jax.Array, dict]:
  """The loss of `model.forward(inputs, segment_ids=..., positions=...)` on a
  batch (the mean over its counted tokens, or its `loss_weights`), and the
  counts the model reports (`Llama.forward`'s; {} for none)."""
  logits_BxLxV, stats = model.forward(batch["inputs"], segment_ids=batch.get("segment_ids"),
                                      positions=batch.get("positions"))
  loss = cross_entropy(logits_BxLxV, batch["targets"], loss_weights(batch))
  return loss, stats if stats is not None else {}
