"""Packed documents (`config.data.packing="segments"`): a token sees only its
own document, positions restart there, and every strategy agrees with one
device (float32), the pipeline included."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import micro_config, tiered
from equivalence import assert_matches_one_device
from test_train_equivalence import STEPS
from meshtrain.errors import ConfigError
from meshtrain.models.llama import Llama
from meshtrain.train.setup import build
from meshtrain.train.parallelize import model_config

def packed_batches(count: int, batch: int, length: int, vocab: int, seed: int = 0,
                   loss_mask: bool = False):
  """Random tokens in documents of random lengths (ids 1, 2, ...), then 0 to
  length/2 tokens of padding (id 0): rows, microbatches and replicas count
  different numbers of tokens, and the loss is the mean over all counted ones.
  With `loss_mask`, a random half of the tokens do not count either (a
  conversation's non-assistant turns)."""
  rng = np.random.default_rng(seed)

  def one():
    tokens = rng.integers(0, vocab, (batch, length + 1), dtype=np.int32)
    segment_ids = np.zeros((batch, length), np.int32)
    for row in segment_ids:
      used = length - rng.integers(0, length // 2 + 1)
      cuts = np.sort(rng.choice(np.arange(1, used), 2, replace=False))
      row[:used] = np.searchsorted(cuts, np.arange(used), side="right") + 1
    packed = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "segment_ids": segment_ids}
    if loss_mask:
      packed["loss_mask"] = rng.integers(0, 2, (batch, length), dtype=np.int32)
    return packed
  return [one() for _ in range(count)]


def micro_model(**model):
  cfg = micro_config()
  cfg.model.update(model)
  return Llama(model_config(cfg), rngs=nnx.Rngs(0))


def test_a_document_sees_neither_the_previous_one_nor_its_place_in_the_window():
  """Document 2 (tokens 6..12) gives the logits it gives alone at the start of
  a window, whatever document 1 holds; padding after it changes nothing."""
  model = micro_model()
  tokens = jax.random.randint(jax.random.key(0), (2, 16), 0, 64)
  segment_ids = jnp.asarray([[1] * 6 + [2] * 7 + [0] * 3] * 2)
  logits = model(tokens, segment_ids=segment_ids)
  other_first = tokens.at[:, :6].set((tokens[:, :6] + 7) % 64)
  other_padding = tokens.at[:, 13:].set((tokens[:, 13:] + 5) % 64)
  alone = model(tokens[:, 6:13])
  for changed in (other_first, other_padding):
    np.testing.assert_allclose(model(changed, segment_ids=segment_ids)[:, 6:13], logits[:, 6:13],
                               rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(logits[:, 6:13], alone, rtol=1e-5, atol=1e-5)
  # Without segments document 1 is visible: the test can fail.
  assert not np.allclose(model(other_first)[:, 6:13], model(tokens)[:, 6:13], atol=1e-3)


def test_cudnn_is_refused_for_packed_documents():
  cfg = micro_config(**{"data.packing": "segments", "attention.implementation": "cudnn"})
  with pytest.raises(ConfigError, match="config.attention.implementation"):
    build(cfg)


CASES = {
    "data=8": dict(mesh=dict(data=8)),
    "fsdp=8 accumulate 2": dict(mesh=dict(data=1, fsdp=8), grad_accum_steps=2),
    "data=4 tensor=2 sequence parallel": dict(mesh=dict(data=4, tensor=2),
                                              tensor_sequence_parallel=True),
    **{f"data=4 sequence=2 {strategy}": dict(mesh=dict(data=4, sequence=2),
                                            attention=dict(sequence_strategy=strategy))
       for strategy in ("ring", "ulysses", "all_gather_kv")},
    "data=4 pipeline=2 1f1b": dict(mesh=dict(data=4, pipeline=2), pipeline=dict(microbatches=2)),
    "data=2 pipeline=2 sequence=2 all_gather_kv": dict(mesh=dict(data=2, pipeline=2, sequence=2),
                                                       pipeline=dict(microbatches=2)),
}


@pytest.mark.parametrize("case", tiered(CASES, ("data=4 sequence=2 ring",)))
def test_packed_training_matches_one_device(case):
  cfg = micro_config(**{"data.packing": "segments"})
  cfg.update(CASES[case])
  batches = packed_batches(STEPS, cfg.global_batch, cfg.seq_len, cfg.model.vocab_size)

  assert_matches_one_device(cfg, batches)


MASKED = {
    "data=8 accumulate 2": dict(mesh=dict(data=8), grad_accum_steps=2),
    "fsdp=4 tensor=2": dict(mesh=dict(data=1, fsdp=4, tensor=2)),
    "data=4 sequence=2 ring": dict(mesh=dict(data=4, sequence=2),
                                   attention=dict(sequence_strategy="ring")),
    "data=2 pipeline=2 fsdp=2 accumulate 2": dict(mesh=dict(data=2, pipeline=2, fsdp=2),
                                                  grad_accum_steps=2,
                                                  pipeline=dict(microbatches=2)),
}


@pytest.mark.parametrize("case", tiered(MASKED, ("data=2 pipeline=2 fsdp=2 accumulate 2",)))
def test_a_loss_mask_makes_the_loss_the_mean_over_the_counted_tokens_of_the_whole_batch(case):
  """Conversations: a token counts where its `loss_mask` is 1 and it is not
  padding. Rows, microbatches, replicas and devices count different numbers
  of tokens; on every mesh, with accumulation and the pipeline, the loss is
  the mean over the counted tokens of the global batch, as the plain
  reference computes it directly on one device."""
  cfg = micro_config(**{"data.packing": "segments"})
  cfg.update(MASKED[case])
  batches = packed_batches(STEPS, cfg.global_batch, cfg.seq_len, cfg.model.vocab_size,
                           loss_mask=True)
  assert_matches_one_device(cfg, batches)
