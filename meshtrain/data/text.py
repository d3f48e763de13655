"""Byte-level text: one token per UTF-8 byte of one file (vocabulary 256), one document.

The file is read once; its windows are those of `meshtrain.data.windows`.
"""

from pathlib import Path

import numpy as np

from meshtrain.data.windows import TokenWindows
from meshtrain.errors import ConfigError

BYTE_VOCAB_SIZE = 256


def text_windows(path: str | None, *, seq_len: int, vocab_size: int) -> TokenWindows:
  """The windows of one text file."""
  tokens = _read_tokens(path, min_tokens=seq_len + 1)
  _check_vocab_size(tokens, vocab_size)
  return TokenWindows(tokens, seq_len=seq_len)


def _read_tokens(path: str | None, *, min_tokens: int) -> np.ndarray:
  fix = "point config.data.path at a UTF-8 text file"
  if not path:
    raise ConfigError("config.data.path", f"is not set; {fix}")
  file = Path(path)
  if not file.is_file():
    raise ConfigError("config.data.path", f"file '{path}' not found; {fix}")
  try:
    data = file.read_bytes()
  except OSError as error:
    raise ConfigError(
        "config.data.path", f"cannot read '{path}' ({error.strerror}); {fix}"
    ) from error
  if not data:
    raise ConfigError("config.data.path", f"file '{path}' is empty; {fix}")
  try:
    data.decode("utf-8")
  except UnicodeDecodeError as error:
    raise ConfigError("config.data.path", f"file '{path}' is not UTF-8 text (byte "
                      f"{error.start} is 0x{data[error.start]:02x}); {fix}, or tokenize "
                      "other data with `meshtrain prepare` and use data.source=tokens") from error
  if len(data) < min_tokens:
    raise ConfigError(
        "config.data.path",
        f"file '{path}' has {len(data)} bytes, fewer than one window of "
        f"seq_len + 1 = {min_tokens}; use a longer file or a shorter seq_len",
    )
  return np.frombuffer(data, dtype=np.uint8)


def _check_vocab_size(tokens: np.ndarray, vocab_size: int) -> None:
  largest = int(tokens.max())
  if largest >= vocab_size:
    raise ConfigError(
        "config.model.vocab_size",
        f"is {vocab_size} but the text has byte value {largest}; byte-level "
        f"text needs vocab_size >= {BYTE_VOCAB_SIZE}",
    )
