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

import asyncio
import contextlib
import json
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


# What a failed save says, in tensorstore's and the OS's words.
_DISK_FAILURE = (r"No space left on device|Read-only file system|Permission denied|"
                 r"Disk quota exceeded|No such file or directory")
# tensorstore's errors (ValueError, status code first) for files that are
# missing, cut short or not what they should be; no code: INVALID_ARGUMENT.
_TENSORSTORE_DAMAGE = re.compile(
    r"(?:(?:NOT_FOUND|DATA_LOSS|OUT_OF_RANGE|FAILED_PRECONDITION|INVALID_ARGUMENT): )?"
    r"Error (?:opening|reading|decoding) ")


def damage_reason(error: BaseException) -> str | None:
  """Why a checkpoint's files are missing or damaged, when `error` or an error
  it was raised from says so (orbax wraps tensorstore's); None for anything
  else (out of memory, a bug), which is no reason to remove a checkpoint."""
  while error is not None:
    if (isinstance(error, (FileNotFoundError, json.JSONDecodeError, UnicodeDecodeError)) or
        (isinstance(error, KeyError) and "was not found in the checkpoint" in str(error)) or
        (type(error) is ValueError and _TENSORSTORE_DAMAGE.match(str(error)))):
      text = str(error.args[0] if isinstance(error, KeyError) else error).strip()
      return text.splitlines()[0].split(" [tensorstore_spec=")[0] if text else type(error).__name__
    error = error.__cause__
  return None


def _runtime_error(error: BaseException) -> BaseException | None:
  """The JAX runtime error that `error` is or was raised from (a collective of
  the save that failed, as when a peer process went away); else None."""
  while error is not None and not isinstance(error, jax.errors.JaxRuntimeError):
    error = error.__cause__ or error.__context__
  return error


def _closed_loop(value, tb) -> bool:
  """asyncio's `Event loop is closed`, met by a callback that native code
  (tensorstore's threads, or a tensorstore future collected in any thread)
  made straight into a closed loop: the traceback holds asyncio's
  `call_soon_threadsafe` and the check that raised, and no Python caller."""
  codes = []
  while tb is not None:
    codes.append(tb.tb_frame.f_code)
    tb = tb.tb_next
  return (isinstance(value, RuntimeError) and str(value) == "Event loop is closed" and
          [code.co_name for code in codes] == ["call_soon_threadsafe", "_check_closed"] and
          all(code.co_filename == asyncio.base_events.__file__ for code in codes))


def _excepthook(kind, value, tb):
  _closed_loop(value, tb) or _Quiet.saved[0](kind, value, tb)


def _orbax_coroutine(unraisable) -> bool:
  """An orbax coroutine left behind by a read that failed: garbage-collected
  unfinished (`Exception ignored in: <coroutine object ...>`)."""
  code = getattr(unraisable.object, "cr_code", None)
  return code is not None and "/orbax/" in code.co_filename.replace("\\", "/")


def _unraisablehook(unraisable):
  (_closed_loop(unraisable.exc_value, unraisable.exc_traceback) or _orbax_coroutine(unraisable)
   or _Quiet.saved[1](unraisable))


def _quieted(except_next, unraisable_next) -> tuple:
  """Hooks that drop orbax's leftover reports and hand the rest on."""
  def excepthook(kind, value, tb):
    _closed_loop(value, tb) or except_next(kind, value, tb)

  def unraisablehook(unraisable):
    (_closed_loop(unraisable.exc_value, unraisable.exc_traceback) or _orbax_coroutine(unraisable)
     or unraisable_next(unraisable))

  unraisablehook.quiets_orbax = True
  return excepthook, unraisablehook


def _not_a_leftover_read(record: logging.LogRecord) -> bool:
  """asyncio's `Task exception was never retrieved`, logged when one of
  orbax's other reads of a checkpoint that failed to read is collected, does
  not pass; asyncio's other records do."""
  error = record.exc_info[1] if record.exc_info else None
  return not (error is not None and "exception was never retrieved" in record.getMessage() and
              (damage_reason(error) is not None or "[tensorstore_spec=" in str(error)))


def _quiet_leftovers() -> None:
  """After a failed restore: orbax's other reads go on, their callbacks meet
  the closed loop and their coroutines are collected unfinished, any time
  until the process exits (which the run's one error line is about to do).
  Wraps the hooks in place (once) so that only those reports are dropped;
  while `_Quiet`'s hooks are installed it wraps those they hand on to (and
  close puts back), so that no hook ends up handing on to itself; adds (once)
  the asyncio log filter for the reads collected unfinished. The absl log
  filter is left as it is."""
  asyncio_log = logging.getLogger("asyncio")
  if _not_a_leftover_read not in asyncio_log.filters:
    asyncio_log.addFilter(_not_a_leftover_read)
  if sys.unraisablehook is _unraisablehook:
    if not getattr(_Quiet.saved[1], "quiets_orbax", False):
      _Quiet.saved = _quieted(*_Quiet.saved)
  elif not getattr(sys.unraisablehook, "quiets_orbax", False):
    sys.excepthook, sys.unraisablehook = _quieted(sys.excepthook, sys.unraisablehook)


def _not_about_a_failed_save(record: logging.LogRecord) -> bool:
  """orbax logs a failed save (a full or read-only disk) from each of its
  threads; `Checkpoints` reports it once. Its other records pass."""
  if record.levelno < logging.ERROR or "/orbax/" not in record.pathname.replace("\\", "/"):
    return True
  error = record.exc_info[1] if record.exc_info else None
  text = f"{record.getMessage()} {error or ''}"
  return not re.search(f"{_DISK_FAILURE}|Event loop is closed", text)


class _Quiet:
  """While a writable `Checkpoints` is open. After one write of a save fails,
  orbax closes its event loop while tensorstore's other writes still call back
  into it; each callback's `RuntimeError: Event loop is closed` reaches
  `sys.excepthook` or `sys.unraisablehook` from tensorstore's threads, and
  orbax logs the failure from each of its threads. The failure itself is
  reported once, by `Checkpoints`. The first to open installs the hooks and
  the log filter, the last to close puts back what was there."""

  users = 0
  saved = (sys.excepthook, sys.unraisablehook)

  @classmethod
  def open(cls) -> None:
    cls.users += 1
    if cls.users == 1:
      cls.saved = sys.excepthook, sys.unraisablehook
      sys.excepthook, sys.unraisablehook = _excepthook, _unraisablehook
      logging.getLogger("absl").addFilter(_not_about_a_failed_save)

  @classmethod
  def close(cls) -> None:
    cls.users -= 1
    if cls.users:
      return
    logging.getLogger("absl").removeFilter(_not_about_a_failed_save)
    if sys.excepthook is _excepthook:  # unless someone has replaced it since
      sys.excepthook = cls.saved[0]
    if sys.unraisablehook is _unraisablehook:
      sys.unraisablehook = cls.saved[1]


class Checkpoints:
  """The step directories under `directory`, newest `keep` kept, one due every
  `every_steps` steps (0: none due)."""

  def __init__(self, directory, *, keep: int = 0, every_steps: int = 0, read_only: bool = False,
               config_key: str):
    """`config_key` names the setting that chose `directory`, for error messages."""
    self.directory = Path(directory).absolute()
    self.config_key, self.every_steps = config_key, every_steps
    self._failed, self._closed, self._quiet = False, False, not read_only
    options = ocp.CheckpointManagerOptions(
        max_to_keep=keep or None, read_only=read_only, create=not read_only,
        cleanup_tmp_directories=not read_only)
    self._manager = ocp.CheckpointManager(self.directory, options=options, item_handlers={
        "state": ocp.StandardCheckpointHandler(), "data": ocp.JsonCheckpointHandler(),
        "config": ocp.JsonCheckpointHandler()})
    if self._quiet:  # only a save makes the noise
      _Quiet.open()

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
    checkpoint does not fit this config, or when its files are missing,
    damaged or fail to read; anything else (out of memory, a bug) goes through.
    """
    path = self.directory / str(step)
    target = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                          abstract_state, shardings)
    with self._reading(step):
      saved = self._manager.item_metadata(step).get("state")
      if saved is None:
        raise FileNotFoundError(f"{path / 'state'} has no metadata")
      mismatch = _mismatch(saved.tree, target, saved_config=self.saved_config(step), cfg=cfg)
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
    """A checkpoint whose files are missing or damaged is one line naming it
    and the fix; one whose files fail to read (an I/O error, no permission), a
    line naming the reason. Other errors are not the checkpoint's."""
    path = self.directory / str(step)
    try:
      yield
    except ConfigError:
      raise
    except Exception as error:
      reason = damage_reason(error)
      if reason is not None or isinstance(error, OSError):
        _quiet_leftovers()
      if reason is not None:
        raise ConfigError(self.config_key, f"checkpoint {path} cannot be read ({reason}); "
                          "remove that step directory to resume from the one before") from None
      if isinstance(error, OSError):
        raise ConfigError(self.config_key, f"checkpoint {path} cannot be read "
                          f"({error.strerror or error})") from None
      raise

  def wait(self) -> None:
    """Blocks until the saves in flight are on disk."""
    with self._writing():
      self._manager.wait_until_finished()

  def close(self) -> None:
    """Waits for the saves in flight; after a failed save, only stops orbax."""
    if self._closed:
      return
    try:
      if self._failed:
        with contextlib.suppress(Exception):
          self._manager.close()
        return
      with self._writing():
        self._manager.close()
    finally:
      self._closed = True
      if self._quiet:
        _Quiet.close()

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
      collective = _runtime_error(error)
      if collective is not None:  # a peer went away mid-save: the watchdog judges (train.loop)
        raise collective from None
      message = str(error)
      known = re.search(_DISK_FAILURE, message)
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
