"""A corpus prepared by `meshtrain prepare` (format: `meshtrain.data.prepare`).

Opening one checks it whole before any batch is read: meta.json present and
complete, token, index and (where meta.json says there is one) loss mask files
of the sizes it states, so a directory that a prepare did not finish (or a
copy that was cut short) is refused with the reason. Tokens and the mask are
memory-mapped: a process reads only the windows it serves.
"""

import json
from pathlib import Path

import numpy as np

from meshtrain.data import prepare as p
from meshtrain.data import tokenizer as tk
from meshtrain.data.windows import TokenWindows
from meshtrain.errors import ConfigError

SPLITS = ("train", "val")


class PreparedCorpus:
  """A prepared directory, checked; `key` names the setting that gave its path."""

  def __init__(self, path: str | None, *, key: str = "config.data.path"):
    fix = "run `meshtrain prepare --input ... --out DIR` and point it at DIR"
    if not path:
      raise ConfigError(key, f"is not set; {fix}")
    self.directory = Path(path)
    meta_file = self.directory / tk.META_FILE
    if not self.directory.is_dir():
      raise ConfigError(key, f"{path} is not a directory; {fix}")
    if not meta_file.is_file():
      partial = sorted(self.directory.parent.glob(f".{self.directory.name}.partial-*"))
      raise ConfigError(key, f"{path} has no {tk.META_FILE}: not a prepared corpus, or one whose "
                        "prepare did not finish" + (f" (unfinished: {partial[0]})" if partial else "")
                        + f"; {fix}")
    try:
      meta = json.loads(meta_file.read_text())
      self.dtype = p.token_dtype(int(meta["vocab_size"]))
      self.num_tokens, self.num_documents = int(meta["tokens"]), int(meta["documents"])
      self.split_ranges = {name: tuple(map(int, meta["split"][name])) for name in SPLITS}
      self.vocab_size, self.eos_id = int(meta["vocab_size"]), int(meta["eos_id"])
      has_loss_mask = meta.get("loss_mask", False)  # format 1 has none
      if (meta["format"] not in p.READABLE_FORMATS or meta["dtype"] != self.dtype.name
          or not isinstance(has_loss_mask, bool)):
        raise ValueError(f"format {meta['format']}, dtype {meta['dtype']}, "
                         f"loss_mask {has_loss_mask}")
    except (OSError, ValueError, KeyError, TypeError, RecursionError) as error:
      raise ConfigError(key, f"{meta_file} is unreadable or incomplete ({error}); prepare the "
                        "corpus again") from None
    self.meta = meta
    self._tokens = self._memmap(key, p.TOKENS_FILE, self.dtype, self.num_tokens)
    self._document_starts = self._memmap(key, p.DOCUMENTS_FILE, np.dtype("<i8"),
                                         self.num_documents + 1)[:-1]
    self._loss_mask = (self._memmap(key, p.LOSS_MASK_FILE, np.dtype("u1"), self.num_tokens)
                       if has_loss_mask else None)

  def _memmap(self, key: str, name: str, dtype: np.dtype, count: int) -> np.ndarray:
    file = self.directory / name
    size = file.stat().st_size if file.is_file() else None
    if size != count * dtype.itemsize:
      found = "is missing" if size is None else f"has {size} bytes"
      raise ConfigError(key, f"{file} {found} where {tk.META_FILE} says "
                        f"{count * dtype.itemsize}: the corpus is incomplete; prepare it again")
    return np.memmap(file, dtype=dtype, mode="r") if count else np.zeros(0, dtype)

  def windows(self, split: str, *, seq_len: int, vocab_size: int, key: str) -> TokenWindows:
    """The windows of one split; `vocab_size` is the model's."""
    if vocab_size < self.vocab_size:
      raise ConfigError("config.model.vocab_size", f"is {vocab_size} but the tokenizer of "
                        f"{self.directory} has {self.vocab_size} ids; set it to at least "
                        f"{self.vocab_size}")
    start, end = self.split_ranges[split]
    if end - start < seq_len + 1:
      raise ConfigError(key, f"the {split} split of {self.directory} has {end - start} tokens, "
                        f"fewer than one window of seq_len + 1 = {seq_len + 1}; prepare more text "
                        "(or another --val_fraction) or use a shorter seq_len")
    starts = self._document_starts
    inside = starts[np.searchsorted(starts, start):np.searchsorted(starts, end)] - start
    if not len(inside) or inside[0]:
      inside = np.concatenate([[0], inside])  # the split opens inside a document
    loss_mask = None if self._loss_mask is None else self._loss_mask[start:end]
    return TokenWindows(self._tokens[start:end], seq_len=seq_len, document_starts=inside,
                        loss_mask=loss_mask)
