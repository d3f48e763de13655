"""The one error type users see for bad input: it names the config key and the fix."""

import contextlib
from collections.abc import Iterator


class ConfigError(ValueError):
  """Bad input. The CLI prints `error: <key>: <message>` on one line and exits 2."""

  def __init__(self, key: str, message: str):
    super().__init__(f"{key}: {message}")
    self.key, self.message = key, message


class StorageError(ConfigError):
  """The disk failed under a running job (full, read-only, removed). The CLI prints
  the one line and exits 2 at once, skipping the exit-time cleanups of libraries
  (TensorBoard, orbax's writer threads) that would fail on the same disk."""


class TrainingHalted(RuntimeError):
  """Training stopped on purpose with a saved state (config.nan_policy=stop); the CLI exits 3."""

  def __init__(self, key: str, message: str):
    super().__init__(f"{key}: {message}")
    self.key = key


@contextlib.contextmanager
def reading(key: str, path) -> Iterator[None]:
  """An OSError inside (a file `key` names that exists but fails to read: an
  I/O error, no permission) becomes one line naming `key` and `path`."""
  try:
    yield
  except OSError as error:
    raise ConfigError(key, f"reading {path} failed ({error.strerror or error})") from None
