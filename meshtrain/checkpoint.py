"""Checkpoints through orbax: async sharded saves, exact resume, restore onto any mesh.

A checkpoint is one step directory with three items: `state` (float32 master
weights, optimizer state, step and non-finite count, each array written from
its own shards), `data` (the grain iterator's position) and `config` (the
resolved config, which also holds the seed). The step itself draws no random
numbers (no dropout) and the data order is a function of (seed, position), so
these three are the whole run.

orbax writes a step into a temporary directory and renames it once every
process has finished, so a crash mid-save leaves the previous step the latest;
the next run removes the leftover temporary directory.

Restoring reads into the shardings of the current run, whatever mesh wrote the
checkpoint (orbax reshards on read). The state tree is the same for every
strategy (a pipeline stage is a slice of the stacked layers), so any strategy
restores any other's.

The data position is one JSON object, not grain's per-process handler (one file
per process, named by the process count): every process is at the same batch
and batches do not depend on the number of processes, so one position restores
in any number of processes.
"""

import contextlib
import logging
import re
import sys
from pathlib import Path
from typing import Any

import grain
import jax
import orbax.checkpoint as ocp

from meshtrain.errors import ConfigError, StorageError


def storage_error(key: str, what: str, reason: str, directory: Path) -> StorageError:
  """`what` failed for `reason`, naming the newest complete checkpoint in `directory`."""
  steps = sorted(int(p.name) for p in directory.glob("*") if p.name.isdigit())
  intact = (f"step {steps[-1]} in {directory / str(steps[-1])} is the newest complete checkpoint"
            if steps else "no checkpoint was completed")
  return StorageError(key, f"{what} failed ({reason}); {intact}. Free space or fix the folder, "
                      "then rerun to resume")


def _not_an_orbax_error(record: logging.LogRecord) -> bool:
  """orbax logs a failed save from each of its threads; `Checkpoints` reports it once."""
  return not (record.levelno >= logging.ERROR and "orbax" in record.pathname)


def _closed_loop(value) -> bool:
  return isinstance(value, RuntimeError) and "Event loop is closed" in str(value)


def _quiet_about_closed_loops() -> None:
  """After one write of a save fails, orbax closes its event loop while
  tensorstore's other writes still call back into it; each callback's
  `RuntimeError: Event loop is closed` reaches `sys.unraisablehook` (from
  tensorstore's threads) or `sys.excepthook`. The failure itself is reported
  once, by `Checkpoints`."""
  if getattr(sys.unraisablehook, "quiet", False):
    return
  excepthook, unraisablehook = sys.excepthook, sys.unraisablehook
  sys.excepthook = lambda kind, value, tb: _closed_loop(value) or excepthook(kind, value, tb)
  sys.unraisablehook = lambda u: _closed_loop(u.exc_value) or unraisablehook(u)
  sys.unraisablehook.quiet = True


class Checkpoints:
  """The step directories under `directory`, newest `keep` kept, one due every
  `every_steps` steps (0: none due)."""

  def __init__(self, directory, *, keep: int = 0, every_steps: int = 0, read_only: bool = False,
               config_key: str):
    """`config_key` names the setting that chose `directory`, for error messages."""
    self.directory = Path(directory).absolute()
    self.config_key, self.every_steps = config_key, every_steps
    self._failed = False
    logging.getLogger("absl").addFilter(_not_an_orbax_error)  # once: the same function
    _quiet_about_closed_loops()
    options = ocp.CheckpointManagerOptions(
        max_to_keep=keep or None, read_only=read_only, create=not read_only,
        cleanup_tmp_directories=not read_only)
    self._manager = ocp.CheckpointManager(self.directory, options=options, item_handlers={
        "state": ocp.StandardCheckpointHandler(), "data": ocp.JsonCheckpointHandler(),
        "config": ocp.JsonCheckpointHandler()})

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def due(self, step: int) -> bool:
    """Whether the run saves after `step` on its own schedule."""
    return bool(self.every_steps) and step % self.every_steps == 0

  def save(self, step: int, state, data_iterator: grain.DatasetIterator, cfg) -> bool:
    """Starts an async save of `step`; False when that step is already saved."""
    if step in self._manager.all_steps():
      return False
    with self._writing():
      return self._manager.save(step, args=ocp.args.Composite(
          state=ocp.args.StandardSave(state),
          data=ocp.args.JsonSave(data_iterator.get_state()),
          config=ocp.args.JsonSave(cfg.to_dict())), force=True)

  def restore(self, step: int, shardings, abstract_state, data_iterator: grain.DatasetIterator,
              cfg):
    """The state of `step` laid out by `shardings`; moves `data_iterator` to its position.

    Raises ConfigError naming the path and the first difference when the
    checkpoint does not fit this config, or when it cannot be read.
    """
    path = self.directory / str(step)
    target = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                          abstract_state, shardings)
    with self._reading(step):
      mismatch = _mismatch(self._manager.item_metadata(step)["state"].tree, target,
                           saved_config=self.saved_config(step), cfg=cfg)
      restored = None if mismatch else self._manager.restore(step, args=ocp.args.Composite(
          state=ocp.args.StandardRestore(target), data=ocp.args.JsonRestore()))
    if mismatch:
      raise ConfigError(self.config_key, f"checkpoint {path} does not fit this config: {mismatch}")
    data_iterator.set_state(restored["data"])
    return restored["state"]

  def saved_config(self, step: int) -> dict:
    """The resolved config that `step` was saved with."""
    with self._reading(step):
      return self._manager.restore(step, args=ocp.args.Composite(
          config=ocp.args.JsonRestore()))["config"]

  @contextlib.contextmanager
  def _reading(self, step: int):
    """A checkpoint that cannot be read is one line naming it."""
    try:
      yield
    except ConfigError:
      raise
    except Exception as error:  # orbax and tensorstore raise many kinds on bad files
      reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
      raise ConfigError(self.config_key, f"checkpoint {self.directory / str(step)} cannot be read "
                        f"({reason}); remove that step directory to resume from the one before"
                        ) from None

  def wait(self) -> None:
    """Blocks until the saves in flight are on disk."""
    with self._writing():
      self._manager.wait_until_finished()

  def close(self) -> None:
    """Waits for the saves in flight; after a failed save, only stops orbax."""
    if self._failed:
      with contextlib.suppress(Exception):
        self._manager.close()
      return
    with self._writing():
      self._manager.close()

  @contextlib.contextmanager
  def _writing(self):
    """A save that fails (a full disk, a read-only or vanished folder; orbax
    reports it at the next save or wait) is one line. orbax renames a step's
    temporary folder only once it is complete, so the newest complete step stays
    the one a rerun resumes from; the next run removes the leftover."""
    try:
      yield
    except Exception as error:  # orbax and tensorstore raise many kinds for an OS error
      self._failed = True
      message = str(error)
      known = re.search(r"No space left on device|Read-only file system|Permission denied|"
                        r"Disk quota exceeded|No such file or directory", message)
      reason = known.group(0) if known else (message.strip().splitlines() or [repr(error)])[0]
      raise storage_error(self.config_key, f"saving a checkpoint into {self.directory}", reason,
                          self.directory) from None


def _mismatch(saved_tree: Any, target, *, saved_config: dict, cfg) -> str | None:
  """The first array whose name, shape or dtype differs, with the model keys that changed."""
  saved = {jax.tree_util.keystr(path, simple=True, separator="/"): leaf for path, leaf in
           jax.tree_util.tree_flatten_with_path(saved_tree)[0]}
  wanted = {jax.tree_util.keystr(path, simple=True, separator="/"): leaf for path, leaf in
            jax.tree_util.tree_flatten_with_path(target)[0]}
  hint = _model_differences(saved_config.get("model", {}), cfg.model.to_dict())
  missing = sorted(set(wanted) - set(saved)) + sorted(set(saved) - set(wanted))
  if missing:
    return f"{missing[0]} is only on one side{hint or ' (the optimizer settings differ)'}"
  for name, want in wanted.items():
    have = saved[name]
    if tuple(have.shape) != tuple(want.shape) or jax.numpy.dtype(have.dtype) != want.dtype:
      return (f"{name} is {have.dtype}{list(have.shape)} there and "
              f"{want.dtype}{list(want.shape)} here{hint}")
  return None


def _model_differences(saved: dict, current: dict) -> str:
  changed = [f"model.{key} {saved.get(key)!r} -> {current[key]!r}"
             for key in current if saved.get(key) != current[key]]
  return f" ({', '.join(changed)})" if changed else ""
