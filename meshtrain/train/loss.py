"""The training loss."""

import jax
import jax.numpy as jnp


def cross_entropy(logits_BxLxV: jax.Array, targets_BxL: jax.Array,
                  weights_BxL: jax.Array | None = None) -> jax.Array:
  """Mean next-token loss that never gathers the vocabulary: the log-sum-exp
  and the target's logit are both reductions over `vocab`, so under vocabulary
  parallelism each device reduces its slice and all-reduces [batch, length].
  With `weights_BxL` (1 = counts, 0 = padding) the mean is over counted tokens."""
  loss_BxL = token_losses(logits_BxLxV, targets_BxL)
  if weights_BxL is None:
    return jnp.mean(loss_BxL)
  weights_BxL = weights_BxL.astype(loss_BxL.dtype)
  return jnp.sum(loss_BxL * weights_BxL) / jnp.maximum(jnp.sum(weights_BxL), 1)


def token_losses(logits_BxLxV: jax.Array, targets_BxL: jax.Array) -> jax.Array:
  """Each token's next-token loss, [batch, length]."""
  target_logit_BxL = jnp.sum(
      logits_BxLxV * jax.nn.one_hot(targets_BxL, logits_BxLxV.shape[-1], dtype=logits_BxLxV.dtype),
      axis=-1)
  return jax.nn.logsumexp(logits_BxLxV, axis=-1) - target_logit_BxL


def model_loss(model, batch: dict[str, jax.Array]) -> tuple[jax.Array, dict]:
  """The loss of `model.forward(inputs, segment_ids=..., positions=...)` on a
  batch, and the counts the model reports (`Llama.forward`'s; {} for none).
  Packed documents (`segment_ids`, 0 = padding): padding's targets do not
  count. The mean is per batch (per microbatch under accumulation, where each
  microbatch weighs the same whatever its padding)."""
  segment_ids_BxL = batch.get("segment_ids")
  logits_BxLxV, stats = model.forward(batch["inputs"], segment_ids=segment_ids_BxL,
                                      positions=batch.get("positions"))
  loss = cross_entropy(logits_BxLxV, batch["targets"], counted_tokens(segment_ids_BxL))
  return loss, stats if stats is not None else {}


def counted_tokens(segment_ids_BxL: jax.Array | None) -> jax.Array | None:
  """The loss weights of packed documents: padding (segment 0) does not count."""
  return None if segment_ids_BxL is None else segment_ids_BxL != 0
