"""The one error type users see for bad input: it names the config key and the fix."""


class ConfigError(ValueError):
  """Bad input. The CLI prints `error: <key>: <message>` on one line and exits 2."""

  def __init__(self, key: str, message: str):
    super().__init__(f"{key}: {message}")
    self.key = key


class StorageError(ConfigError):
  """The disk failed under a running job (full, read-only, removed). The CLI prints
  the one line and exits 2 at once, skipping the exit-time cleanups of libraries
  (TensorBoard, orbax's writer threads) that would fail on the same disk."""


class TrainingHalted(RuntimeError):
  """Training stopped on purpose with a saved state (config.nan_policy=stop); the CLI exits 3."""

  def __init__(self, key: str, message: str):
    super().__init__(f"{key}: {message}")
    self.key = key
