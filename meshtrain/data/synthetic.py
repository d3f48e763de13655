"""A built-in learnable task: arithmetic progressions modulo the vocabulary.

Each window of `seq_len + 1` tokens is

  x[t] = (start + stride * t) mod vocab_size,   t = 0 .. seq_len

for one of the `vocab_size * len(STRIDES)` pairs (start, stride), start in
[0, vocab_size) and stride in `STRIDES`. Window id `i` is the pair
(i mod vocab_size, STRIDES[i // vocab_size]); the shared epoch shuffle draws
every pair once per epoch in a seeded order, so the task needs no files and is
deterministic from the seed and the row index.

Why it trains quickly and shows progress: a bigram model already predicts the
next token up to the unknown stride (loss log(len(STRIDES)) instead of
log(vocab_size)); attending to the previous token pins the stride down, after
which every further token is determined.

Loss floor: `x[0]` is only ever an input, never a target. The first target
`x[1]` is uniform over `len(STRIDES)` values given `x[0]`; every later target is
determined by the two tokens before it. The mean next-token cross-entropy over
the `seq_len` targets therefore cannot go below
`log(len(STRIDES)) / seq_len` nats (see `synthetic_loss_floor`).
"""

import math

import numpy as np

from meshtrain.errors import ConfigError

STRIDES = (1, 2, 3, 4)


class SyntheticWindows:
  """All progression windows, indexed by window id (see module docstring)."""

  def __init__(self, *, seq_len: int, vocab_size: int):
    _check_vocab_size(vocab_size)
    self.num_windows = vocab_size * len(STRIDES)
    self._vocab_size = vocab_size
    self._offsets = np.arange(seq_len + 1, dtype=np.int64)
    self._strides = np.array(STRIDES, dtype=np.int64)

  def __call__(self, ids: np.ndarray) -> np.ndarray:
    """int64[len(ids), seq_len + 1] windows for the window ids."""
    stride_choice, start = np.divmod(ids, self._vocab_size)
    stride = self._strides[stride_choice]
    progression = start[:, None] + stride[:, None] * self._offsets
    return progression % self._vocab_size

  def loss_mask(self, ids: np.ndarray) -> None:
    """Every target counts."""
    del ids

  def segments(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each window is one document."""
    seq_len = len(self._offsets) - 1
    return (np.ones((len(ids), seq_len), np.int32),
            np.broadcast_to(np.arange(seq_len, dtype=np.int32), (len(ids), seq_len)).copy())


def synthetic_loss_floor(seq_len: int, vocab_size: int) -> float:
  """The irreducible mean next-token loss (nats) of the synthetic task."""
  _check_vocab_size(vocab_size)
  return math.log(len(STRIDES)) / seq_len


def _check_vocab_size(vocab_size: int) -> None:
  """Strides must differ modulo the vocabulary, or two tokens can't fix them."""
  if vocab_size <= max(STRIDES):
    raise ConfigError(
        "config.model.vocab_size",
        f"is {vocab_size}; the synthetic task needs more than {max(STRIDES)} "
        "tokens so its strides stay distinct",
    )
