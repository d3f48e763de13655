"""Windows over one flat token stream, and the documents inside each window.

Window id `i` is the `seq_len + 1` tokens starting at token `i * seq_len`:
neighbouring windows share one token, so each epoch every token is a target
once, except the first and a tail shorter than `seq_len`. Documents follow
each other in the stream (each ended by its EOS); `document_starts` says where
each one begins, which is what packing with segments needs. A `loss_mask`
beside the tokens (conversations: 1 on the assistant's tokens) says which
tokens count as targets.
"""

import numpy as np


class TokenWindows:
  """The windows of `tokens` (any integer array, a memmap included), by window id."""

  def __init__(self, tokens: np.ndarray, *, seq_len: int, document_starts: np.ndarray | None = None,
               loss_mask: np.ndarray | None = None):
    """`document_starts`: sorted offsets in `tokens` where documents begin, the
    first 0 (default: one document); `loss_mask`: 0 or 1 for each token, whether
    it counts as a target (default: every token counts)."""
    self._tokens = tokens
    self._loss_mask = loss_mask
    self._seq_len = seq_len
    self._offsets = np.arange(seq_len + 1)
    self._document_starts = np.zeros(1, np.int64) if document_starts is None else document_starts
    self.num_windows = (len(tokens) - 1) // seq_len

  def __call__(self, ids: np.ndarray) -> np.ndarray:
    """[len(ids), seq_len + 1] windows for the window ids."""
    return self._tokens[ids[:, None] * self._seq_len + self._offsets]

  def loss_mask(self, ids: np.ndarray) -> np.ndarray | None:
    """Whether each target of each window counts, int32[len(ids), seq_len]
    (aligned with the targets, the window's tokens 1 to seq_len); None when
    every token counts."""
    if self._loss_mask is None:
      return None
    return self._loss_mask[ids[:, None] * self._seq_len + self._offsets[1:]].astype(np.int32)

  def segments(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Segment ids and positions of the inputs of each window, int32[len(ids), seq_len].

    The documents in a window are numbered from 1 in order; a position counts
    from the start of its document, or from the window's start for the
    document the window opens inside of.
    """
    token_at_BxL = ids[:, None] * self._seq_len + self._offsets[:-1]
    document_BxL = np.searchsorted(self._document_starts, token_at_BxL, side="right") - 1
    segment_ids_BxL = document_BxL - document_BxL[:, :1] + 1
    start_BxL = np.maximum(self._document_starts[document_BxL], token_at_BxL[:, :1])
    return segment_ids_BxL.astype(np.int32), (token_at_BxL - start_BxL).astype(np.int32)
