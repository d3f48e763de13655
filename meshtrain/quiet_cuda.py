"""jax's CUDA plugin on a machine without an NVIDIA driver, kept quiet.

The `dev` extra installs the plugin to compile for GPUs on any machine
(`meshtrain.gpu_targets`). Where no driver is present (CI, a laptop), the
plugin's libraries print "Could not find cuda drivers" lines on stderr when
`import jax` and the first backend load them, and its version check raises a
traceback when jax starts its backends. `start()`, run when meshtrain is
imported, loads those libraries once with those lines filtered out and skips
the version check, which cannot pass without a driver: jax then runs on the
CPU as it does without the plugin. On a machine with a driver, or without the
plugin, it does nothing.
"""

import contextlib
import ctypes
import functools
import importlib.util
import os
import sys
import tempfile
from collections.abc import Iterator

_PLUGIN = "jax_plugins.xla_cuda12"
# What the plugin's libraries print when they find no driver (C++ logging, on fd 2).
NOISE = ("cudart_stub.cc", "All log messages before absl::InitializeLog() is called")


@functools.cache
def plugin_installed() -> bool:
  return importlib.util.find_spec(_PLUGIN) is not None


@functools.cache
def no_driver() -> bool:
  """Whether the plugin is installed on a machine without an NVIDIA driver."""
  if not plugin_installed():
    return False
  try:
    ctypes.CDLL("libcuda.so.1")
  except OSError:
    return True
  return False


@contextlib.contextmanager
def stderr_filtered() -> Iterator[None]:
  """What the process writes on stderr (fd 2, C++ included) meanwhile, less the `NOISE` lines."""
  sys.stderr.flush()
  saved = os.dup(2)
  with tempfile.TemporaryFile(mode="w+b") as captured:
    os.dup2(captured.fileno(), 2)
    try:
      yield
    finally:
      sys.stderr.flush()
      os.dup2(saved, 2)
      os.close(saved)
      captured.seek(0)
      kept = [line for line in captured.read().decode(errors="replace").splitlines(True)
              if not any(noise in line for noise in NOISE)]
      sys.stderr.write("".join(kept))


def start() -> None:
  if not no_driver():
    return
  os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
  plugin = importlib.util.find_spec(_PLUGIN)
  with stderr_filtered():
    import jax  # noqa: F401, PLC0415 (its import loads the plugin's CUDA helpers)
    # The PJRT library the first backend start loads: loaded here, it is not loaded again.
    ctypes.CDLL(os.path.join(os.path.dirname(plugin.origin), "xla_cuda_plugin.so"))
