"""Training batches through grain: one seeded global stream, sliced per process.

A source is a fixed set of windows of `seq_len + 1` tokens, addressed by window
id: the synthetic task, the bytes of one text file, or a corpus prepared by
`meshtrain prepare` (its train or validation split). The stream visits every window once per epoch, each epoch in a fresh order
drawn from (seed, epoch). Global batch k is rows [k * global_batch,
(k + 1) * global_batch) of that stream and a process reads only the rows its
devices hold (a contiguous block), so the data order does not depend on the
number of processes.

grain serves batch k as element k of `MapDataset.range`, prefetched in
threads; the iterator's `get_state()` / `set_state()` restore the exact step.
Batches are built with vectorized numpy rather than grain's per-row `shuffle`,
`repeat` and `batch`: those cost ~10 us of Python per row, and `shuffle` costs
up to milliseconds per row on datasets of fewer than a few thousand windows.

Packing (`config.data.packing`): windows are cut from documents joined with
their EOS. "concat" lets attention run across document boundaries (GPT);
"auto" (the default) is "segments" for a corpus with a loss mask (a
conversation must not attend to the one before it) and "concat" otherwise
(`packing`); "segments" adds `segment_ids` and `positions` to each batch (int32, like
`inputs`) so the model attends only inside a document and restarts positions
at each one (MaxText, Levanter). The synthetic task counts each window as one
document, a text file as one.

Loss mask: a corpus prepared from conversations (`meshtrain prepare --format
chat`) adds `loss_mask` to each batch, in both splits: int32 [rows, seq_len],
aligned with `targets`, 1 where the target token counts in the loss (the
assistant's turns), 0 where it does not. Other sources add no such key: every
target counts.
"""

import functools
import json
import sys
from pathlib import Path
from typing import Any, Protocol

import grain
import numpy as np

from meshtrain.data.synthetic import (
    STRIDES,
    SyntheticWindows,
    synthetic_loss_floor,
)
from meshtrain.data.text import BYTE_VOCAB_SIZE, text_windows
from meshtrain.data import tokenizer as tk
from meshtrain.data.tokens import SPLITS, PreparedCorpus
from meshtrain.errors import ConfigError

__all__ = [
    "BYTE_VOCAB_SIZE",
    "SOURCES",
    "STRIDES",
    "make_iterator",
    "synthetic_loss_floor",
]

SOURCES = ("synthetic", "text", "tokens")
PACKING = ("auto", "concat", "segments")


def packing(data_cfg: Any) -> str:
  """`data_cfg.packing` as a run uses it: "auto" is "segments" for a prepared
  corpus whose meta.json says it carries a loss mask, else "concat"."""
  chosen = getattr(data_cfg, "packing", "auto")
  if chosen != "auto":
    return chosen
  if data_cfg.source != "tokens" or not data_cfg.path:
    return "concat"
  try:
    masked = json.loads((Path(data_cfg.path) / tk.META_FILE).read_text()).get("loss_mask")
  except (OSError, ValueError, AttributeError):  # reading the corpus reports it
    masked = False
  return "segments" if masked is True else "concat"

# Elements are whole per-process batches: a few in flight hide their cost
# behind the training step without holding much memory.
_READ_OPTIONS = grain.ReadOptions(num_threads=2, prefetch_buffer_size=4)


class _Windows(Protocol):
  """A source: `num_windows` windows, fetched in bulk by window id."""

  num_windows: int

  def __call__(self, ids: np.ndarray) -> np.ndarray:
    """Integer array [len(ids), seq_len + 1]."""

  def segments(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Segment ids and positions of the inputs, int32[len(ids), seq_len]."""

  def loss_mask(self, ids: np.ndarray) -> np.ndarray | None:
    """Whether each target counts, int32[len(ids), seq_len]; None when all do."""


def make_iterator(
    data_cfg: Any,
    *,
    seq_len: int,
    global_batch: int,
    vocab_size: int,
    seed: int,
    rows: range | None = None,
    split: str = "train",
) -> grain.DatasetIterator:
  """Yields rows `rows` (default: all) of each global batch.

  Each element is `{"inputs": int32[len(rows), seq_len],
  "targets": same}`, the targets being the inputs shifted by one token, and
  with `data_cfg.packing="segments"` also `segment_ids` and `positions`, and
  for a corpus with a loss mask also `loss_mask` (module docstring).
  `data_cfg` needs `source` (one of `SOURCES`) and, for "text" and "tokens",
  `path`; `split` picks a prepared corpus's split (module `tokens`).
  """
  if global_batch <= 0:
    raise ConfigError("config.global_batch", f"is {global_batch}; use a positive number")
  rows = range(global_batch) if rows is None else rows
  if not 0 <= rows.start < rows.stop <= global_batch:
    raise ValueError(f"rows {rows} are not inside a batch of {global_batch}")
  if seed < 0:
    raise ConfigError("config.seed", f"is {seed}; use a non-negative integer")
  if getattr(data_cfg, "packing", "auto") not in PACKING:
    raise ConfigError("config.data.packing", f"{data_cfg.packing!r} is not one of "
                      f"{', '.join(PACKING)}")
  packed = packing(data_cfg) == "segments"
  windows = _windows(data_cfg, seq_len=seq_len, vocab_size=vocab_size, split=split)
  shuffle = _EpochShuffle(windows.num_windows, seed)
  rows_in_batch = np.arange(rows.start, rows.stop)

  def local_batch_at(step: int) -> dict[str, np.ndarray]:
    ids = shuffle(step * global_batch + rows_in_batch)
    batch = _inputs_and_targets(windows(ids))
    loss_mask = windows.loss_mask(ids)
    if loss_mask is not None:
      batch["loss_mask"] = loss_mask
    if packed:
      batch["segment_ids"], batch["positions"] = windows.segments(ids)
    return batch

  steps = grain.MapDataset.range(sys.maxsize).map(local_batch_at)
  return iter(steps.to_iter_dataset(_READ_OPTIONS))


def _windows(data_cfg: Any, *, seq_len: int, vocab_size: int, split: str) -> _Windows:
  source, path = getattr(data_cfg, "source", None), getattr(data_cfg, "path", None)
  if split not in SPLITS:
    raise ValueError(f"split {split!r} is not one of {SPLITS}")
  if source == "synthetic":  # one task, no held-out part: every split is the task
    return SyntheticWindows(seq_len=seq_len, vocab_size=vocab_size)
  if source == "text":
    if split != "train":
      raise ConfigError("config.data.source", "a text file has no validation split; prepare it "
                        "with `meshtrain prepare` and use source=tokens to evaluate")
    return text_windows(path, seq_len=seq_len, vocab_size=vocab_size)
  if source == "tokens":
    return PreparedCorpus(path).windows(split, seq_len=seq_len, vocab_size=vocab_size,
                                        key="config.data.path")
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
