"""Training batches through grain: one seeded global stream, sliced per process.

A source is a fixed set of windows of `seq_len + 1` tokens, addressed by window
id. The stream visits every window once per epoch, each epoch in a fresh order
drawn from (seed, epoch). Global batch k is rows [k * global_batch,
(k + 1) * global_batch) of that stream and a process reads only the rows its
devices hold (a contiguous block), so the data order does not depend on the
number of processes.

grain serves batch k as element k of `MapDataset.range`, prefetched in
threads; the iterator's `get_state()` / `set_state()` restore the exact step.
Batches are built with vectorized numpy rather than grain's per-row `shuffle`,
`repeat` and `batch`: those cost ~10 us of Python per row, and `shuffle` costs
up to milliseconds per row on datasets of fewer than a few thousand windows.
"""

import functools
import sys
from typing import Any, Protocol

import grain
import numpy as np

from meshtrain.data.synthetic import (
    STRIDES,
    SyntheticWindows,
    synthetic_loss_floor,
)
from meshtrain.data.text import BYTE_VOCAB_SIZE, TextWindows
from meshtrain.errors import ConfigError

__all__ = [
    "BYTE_VOCAB_SIZE",
    "SOURCES",
    "STRIDES",
    "make_iterator",
    "synthetic_loss_floor",
]

SOURCES = ("synthetic", "text")

# Elements are whole per-process batches: a few in flight hide their cost
# behind the training step without holding much memory.
_READ_OPTIONS = grain.ReadOptions(num_threads=2, prefetch_buffer_size=4)


class _Windows(Protocol):
  """A source: `num_windows` windows, fetched in bulk by window id."""

  num_windows: int

  def __call__(self, ids: np.ndarray) -> np.ndarray:
    """Integer array [len(ids), seq_len + 1]."""


def make_iterator(
    data_cfg: Any,
    *,
    seq_len: int,
    global_batch: int,
    vocab_size: int,
    seed: int,
    rows: range | None = None,
) -> grain.DatasetIterator:
  """Yields rows `rows` (default: all) of each global batch.

  Each element is `{"inputs": int32[len(rows), seq_len],
  "targets": same}`, the targets being the inputs shifted by one token.
  `data_cfg` needs `source` (one of `SOURCES`) and, for "text", `path`.
  """
  if global_batch <= 0:
    raise ConfigError("config.global_batch", f"is {global_batch}; use a positive number")
  rows = range(global_batch) if rows is None else rows
  if not 0 <= rows.start < rows.stop <= global_batch:
    raise ValueError(f"rows {rows} are not inside a batch of {global_batch}")
  if seed < 0:
    raise ConfigError("config.seed", f"is {seed}; use a non-negative integer")
  windows = _windows(data_cfg, seq_len=seq_len, vocab_size=vocab_size)
  shuffle = _EpochShuffle(windows.num_windows, seed)
  rows_in_batch = np.arange(rows.start, rows.stop)

  def local_batch_at(step: int) -> dict[str, np.ndarray]:
    rows = step * global_batch + rows_in_batch
    return _inputs_and_targets(windows(shuffle(rows)))

  steps = grain.MapDataset.range(sys.maxsize).map(local_batch_at)
  return iter(steps.to_iter_dataset(_READ_OPTIONS))


def _windows(data_cfg: Any, *, seq_len: int, vocab_size: int) -> _Windows:
  source = getattr(data_cfg, "source", None)
  if source == "synthetic":
    return SyntheticWindows(seq_len=seq_len, vocab_size=vocab_size)
  if source == "text":
    path = getattr(data_cfg, "path", None)
    return TextWindows(path, seq_len=seq_len, vocab_size=vocab_size)
  raise ConfigError(
      "config.data.source",
      f"unknown source {source!r}; use one of {', '.join(SOURCES)}",
  )


class _EpochShuffle:
  """Maps stream rows to window ids, each epoch in a fresh seeded order."""

  def __init__(self, num_windows: int, seed: int):
    self._num_windows = num_windows
    self._seed = seed
    # A batch spans at most two epochs unless the source is tiny.
    self._permutation = functools.lru_cache(maxsize=4)(self._draw_permutation)

  def __call__(self, rows: np.ndarray) -> np.ndarray:
    epochs, positions = np.divmod(rows, self._num_windows)
    ids = np.empty_like(rows)
    for epoch in np.unique(epochs):
      in_epoch = epochs == epoch
      ids[in_epoch] = self._permutation(int(epoch))[positions[in_epoch]]
    return ids

  def _draw_permutation(self, epoch: int) -> np.ndarray:
    rng = np.random.default_rng((self._seed, epoch))
    return rng.permutation(self._num_windows)


def _inputs_and_targets(windows: np.ndarray) -> dict[str, np.ndarray]:
  return {
      "inputs": np.ascontiguousarray(windows[:, :-1], dtype=np.int32),
      "targets": np.ascontiguousarray(windows[:, 1:], dtype=np.int32),
  }
