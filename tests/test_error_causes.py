"""Errors that name their real cause: a file that fails to read is reported
against the flag that named it (not as the workdir's disk), a restore that
fails for a reason other than damaged files goes through with its own message
(no advice to delete a good checkpoint), and the checkpointer's quieting of
orbax's noise is narrow and put back when it closes.

A real read error (EIO) comes from /proc/self/mem, which cannot be read at
offset 0 by anyone, root included; a symlink gives it the input's name.
"""

import asyncio
import errno
import gc
import hashlib
import logging
import os
import shutil
import sys
import threading
import types
import weakref
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from conftest import micro_config, micro_flags
from meshtrain import checkpoint, cli, workdir as saved_run
from meshtrain.checkpoint import Checkpoints
from meshtrain.data import prepare
from meshtrain.errors import ConfigError

EIO = Path("/proc/self/mem")


def unreadable(path: Path) -> Path:
  """`path`, which exists and fails to read with an I/O error."""
  try:
    EIO.read_bytes()
  except OSError as error:
    if error.errno != errno.EIO:
      pytest.skip(f"{EIO} fails with {error} here, not an I/O error")
  else:
    pytest.skip(f"{EIO} reads here")
  path.parent.mkdir(parents=True, exist_ok=True)
  path.symlink_to(EIO)
  return path


@pytest.fixture
def meshtrain(capsys, monkeypatch):
  """`meshtrain ARGS` in this process: exit code and stderr. A disk failure's
  immediate exit (os._exit) is an ordinary one here, so that the test reports it."""
  monkeypatch.setattr(os, "_exit", sys.exit)

  def run(args: list[str]) -> tuple[int, str]:
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
      cli.run(args)
    return exit_info.value.code, capsys.readouterr().err
  return run


def digest(root: Path) -> dict[str, str]:
  return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file()
          else "folder" for p in sorted(root.rglob("*"))}


# Files and their flags

@pytest.mark.parametrize("name", ["book.txt", "chats.jsonl"])
def test_prepare_names_an_input_that_fails_to_read_and_writes_nothing(tmp_path, meshtrain, name):
  source = unreadable(tmp_path / "in" / name)
  code, stderr = meshtrain(["prepare", "--input", str(source), "--out", str(tmp_path / "a/out")])
  assert code == 2
  assert stderr.strip().splitlines() == [
      f"error: --input: reading {source} failed (Input/output error)"]
  assert sorted(tmp_path.iterdir()) == [tmp_path / "in"]


def test_prepare_names_out_when_writing_fails_and_leaves_nothing(tmp_path, meshtrain,
                                                                  monkeypatch):
  (tmp_path / "in").mkdir()
  (tmp_path / "in/a.txt").write_text("Some text to prepare.\n")

  def full_disk(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))  # as a write to an open file does
  monkeypatch.setattr(prepare, "_write_tokens", full_disk)
  out = tmp_path / "new/sub/out"
  code, stderr = meshtrain(["prepare", "--input", str(tmp_path / "in/a.txt"), "--out", str(out)])
  assert code == 2
  assert stderr.strip().splitlines() == [
      f"error: --out: writing {out} failed (No space left on device)"]
  assert sorted(tmp_path.iterdir()) == [tmp_path / "in"]


def test_a_saved_run_whose_config_fails_to_read_names_workdir(tmp_path, meshtrain):
  config = unreadable(tmp_path / "run/config.json")
  code, stderr = meshtrain(["eval", "--workdir", str(tmp_path / "run")])
  assert code == 2
  assert stderr.strip().splitlines() == [
      f"error: --workdir: reading {config} failed (Input/output error)"]


def test_a_cluster_file_that_fails_to_read_names_cluster(tmp_path, meshtrain):
  cluster = unreadable(tmp_path / "cluster.json")
  code, stderr = meshtrain(["plan", "--search", "--cluster", str(cluster), "--devices", "8",
                            *micro_flags()])
  assert code == 2
  assert stderr.strip().splitlines() == [
      f"error: --cluster: reading {cluster} failed (Input/output error)"]


def test_a_hugging_face_index_that_fails_to_read_names_from(tmp_path, meshtrain):
  (tmp_path / "hf").mkdir()
  (tmp_path / "hf/config.json").write_text(
      '{"model_type": "llama", "hidden_size": 16, "intermediate_size": 32, '
      '"num_hidden_layers": 1, "num_attention_heads": 2, "vocab_size": 64}')
  index = unreadable(tmp_path / "hf/model.safetensors.index.json")
  code, stderr = meshtrain(["import-hf", "--from", str(tmp_path / "hf"),
                            "--to", str(tmp_path / "out")])
  assert code == 2
  assert stderr.strip().splitlines()[-1] == (
      f"error: --from: reading {index} failed (Input/output error)")
  assert not (tmp_path / "out").exists()


def test_a_metrics_file_that_fails_to_close_still_lets_the_last_checkpoint_finish(
    tmp_path, monkeypatch):
  """A full disk that fails the metrics file's close: the saves in flight are
  still waited for, so the last checkpoint is complete (or absent), never cut."""
  from meshtrain.train import loop, metrics
  from meshtrain.train.watchdog import newest_checkpoint

  def full_disk(self):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
  monkeypatch.setattr(metrics.MetricsWriter, "close", full_disk)
  cfg = micro_config(steps=3, workdir=str(tmp_path))
  with pytest.raises(OSError, match="No space left"):
    loop.train(cfg)
  assert newest_checkpoint(tmp_path) == 3
  assert not list((tmp_path / "checkpoints").glob("*tmp*"))


# Restores that fail

class Position:
  """A data iterator's position, as `Checkpoints` saves and restores it."""

  def __init__(self):
    self.state = {"next_index": 3}

  def get_state(self):
    return self.state

  def set_state(self, state):
    self.state = state


STATE = {"params": {"w": jnp.arange(1024, dtype=jnp.float32).reshape(16, 64)}}  # not inlined


def test_a_save_whose_collective_fails_is_the_watchdogs_to_judge_not_the_disks(
    tmp_path, monkeypatch):
  """A collective of a save that fails (gloo's `Connection reset by peer` as a
  peer process dies; orbax raises it from its own error) is no storage error:
  the JAX error reaches the train loop, whose watchdog judges the peers."""
  checkpoints = Checkpoints(tmp_path / "checkpoints", config_key="config.workdir")
  lost = jax.errors.JaxRuntimeError("UNKNOWN: Gloo AllGather failed: [pair.cc:538] Read error "
                                    "[127.0.0.1]:27797: Connection reset by peer")

  def save(*args, **kwargs):
    raise RuntimeError("a save's finalization failed") from lost
  monkeypatch.setattr(checkpoints._manager, "save", save)
  with pytest.raises(jax.errors.JaxRuntimeError) as error:
    checkpoints.save(1, STATE, Position(), micro_config())
  assert error.value is lost
  checkpoints.close()


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
  """A run's workdir with one tiny checkpoint, step 1."""
  workdir = tmp_path_factory.mktemp("saved") / "run"
  checkpoints = Checkpoints(workdir / "checkpoints", config_key="test")
  checkpoints.save(1, STATE, Position(), micro_config())
  checkpoints.close()
  return workdir


def copy(saved: Path, tmp_path: Path) -> Path:
  shutil.copytree(saved, tmp_path / "run")
  return tmp_path / "run"


def restore(workdir: Path):
  sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  checkpoints = Checkpoints(workdir / "checkpoints", read_only=True, config_key="config.workdir")
  try:
    return checkpoints.restore(1, jax.tree.map(lambda _: sharding, STATE),
                               jax.eval_shape(lambda: STATE), Position(), micro_config())
  finally:
    checkpoints.close()


def load_params(workdir: Path, shape=(16, 64)):
  sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  return saved_run.load_params(workdir, 1, {"w": jax.ShapeDtypeStruct(shape, jnp.float32)},
                               {"w": sharding})


@pytest.mark.parametrize("error", [MemoryError("out of memory"), RuntimeError("bug")],
                         ids=["MemoryError", "RuntimeError"])
def test_a_restore_that_fails_for_another_reason_goes_through(saved, tmp_path, monkeypatch,
                                                               error):
  workdir = copy(saved, tmp_path)
  before = digest(workdir)

  def fail(*args, **kwargs):
    raise error
  monkeypatch.setattr(ocp.CheckpointManager, "restore", fail)
  monkeypatch.setattr(ocp.PyTreeCheckpointer, "restore", fail)
  for read in (restore, load_params):
    with pytest.raises(type(error)) as raised:
      read(workdir)
    assert raised.value is error and not isinstance(raised.value, ConfigError)
  assert digest(workdir) == before


def test_train_does_not_advise_deleting_a_checkpoint_it_failed_to_restore_for_a_bug(
    saved, tmp_path, monkeypatch, capsys):
  workdir = copy(saved, tmp_path)
  before = digest(workdir)

  def bug(*args, **kwargs):
    raise RuntimeError("bug")
  monkeypatch.setattr(ocp.CheckpointManager, "restore", bug)
  capsys.readouterr()
  with pytest.raises(RuntimeError, match="^bug$"):
    cli.run(["train", *micro_flags(workdir=workdir)])
  assert "remove that step" not in capsys.readouterr().err
  assert digest(workdir) == before


def _delete(path: Path):
  if path.is_dir():
    shutil.rmtree(path)
  else:
    path.unlink()


def _truncate(path: Path):
  path.write_bytes(path.read_bytes()[:len(path.read_bytes()) // 2])


def _garbage(path: Path):
  path.write_bytes(b"garbage")


# What orbax and tensorstore raise for each (found by trying): FileNotFoundError,
# json.JSONDecodeError, KeyError("Item ... was not found in the checkpoint"),
# ValueError("DATA_LOSS: / OUT_OF_RANGE: / FAILED_PRECONDITION: Error reading ...")
# and Exception("Encountered error while reading array index ...") raised from one.
DAMAGES = {
    "state metadata deleted": ("state/_METADATA", _delete),
    "state metadata truncated": ("state/_METADATA", _truncate),
    "data position garbage": ("data/metadata", _garbage),
    "data item deleted": ("data", _delete),
    "manifest truncated": ("state/manifest.ocdbt", _truncate),
    "sharding garbage": ("state/_sharding", _garbage),
    "array chunks deleted": ("state/ocdbt.process_0", _delete),
}


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_a_damaged_checkpoint_is_one_line_advising_the_step_before(saved, tmp_path, damage):
  workdir = copy(saved, tmp_path)
  name, spoil = DAMAGES[damage]
  spoil(workdir / "checkpoints/1" / name)
  with pytest.raises(ConfigError, match=r"^config.workdir: checkpoint .*/1 cannot be read "
                                        r"\(.+\); remove that step directory") as raised:
    restore(workdir)
  assert "\n" not in str(raised.value) and "tensorstore_spec" not in str(raised.value)


def test_reading_weights_names_damage_and_misfit_apart(saved, tmp_path):
  workdir = copy(saved, tmp_path)
  np.testing.assert_array_equal(load_params(workdir)["w"], STATE["params"]["w"])
  with pytest.raises(ConfigError, match=r"cannot be read into this config's model \(Requested "
                                        r"shape: \(16, 32\) is not compatible"):
    load_params(workdir, shape=(16, 32))
  _delete(workdir / "checkpoints/1/state/ocdbt.process_0")
  with pytest.raises(ConfigError, match=r"^--workdir: checkpoint 1 in .* cannot be read \(.+\); "
                                        "its files are missing or damaged"):
    load_params(workdir)


# The checkpointer's hooks and log filter

class _CallsLoop:
  """Calls `loop` from Python when collected: an error then is an unraisable exception."""

  def __init__(self, loop):
    self.loop = loop

  def __del__(self):
    self.loop.call_soon_threadsafe(print)


def _unraisable(loop, *, native: bool, in_thread: bool) -> None:
  """A call into `loop` as a collected object makes it: from native code (a
  weak reference's callback, as tensorstore calls back) or from Python."""
  def drop():
    if native:
      target = lambda: None  # noqa: E731 (any object a weak reference can watch)
      reference = weakref.ref(target, loop.call_soon_threadsafe)
      del target
      assert reference() is None
    else:
      _CallsLoop(loop)
    gc.collect()
  if in_thread:
    thread = threading.Thread(target=drop)
    thread.start()
    thread.join()
  else:
    drop()


def _orbax_record(message: str) -> logging.LogRecord:
  return logging.LogRecord("absl", logging.ERROR, "/lib/site-packages/orbax/checkpoint/x.py", 1,
                           message, None, None)


def test_quieting_a_failed_restores_leftovers_twice_hands_other_reports_on(tmp_path, monkeypatch):
  """A failed restore inside an open checkpointer, closed, then another
  opened and failing again in the same process (a notebook, the tests): each
  unrelated report still reaches the original hook once, with no hook
  handing on to itself (a RecursionError at exit, before)."""
  seen = []
  monkeypatch.setattr(sys, "unraisablehook", lambda unraisable: seen.append(unraisable.exc_value))
  monkeypatch.setattr(sys, "excepthook", lambda *args: seen.append(args[1]))
  monkeypatch.setattr(checkpoint._Quiet, "users", 0)
  for _ in range(2):
    checkpoints = Checkpoints(tmp_path / "checkpoints", config_key="test")
    checkpoint._quiet_leftovers()
    checkpoints.close()
  error = ValueError("unrelated")
  sys.unraisablehook(types.SimpleNamespace(exc_type=ValueError, exc_value=error,
                                           exc_traceback=None, err_msg=None, object=None))
  sys.excepthook(ValueError, ValueError("also unrelated"), None)
  assert [str(e) for e in seen] == ["unrelated", "also unrelated"]


def _collected_unretrieved(error: Exception) -> None:
  """A task that raised `error` collected with it unretrieved, as orbax's other
  reads are after one fails: asyncio logs `Task exception was never retrieved`."""
  async def fail():
    raise error
  loop = asyncio.new_event_loop()
  task = loop.create_task(fail())
  loop.run_until_complete(asyncio.sleep(0))
  loop.close()
  del task
  gc.collect()


def test_after_a_failed_restore_asyncio_logs_no_read_collected_unfinished(monkeypatch):
  """orbax's other reads of a checkpoint that failed to read, collected with
  their tensorstore errors unretrieved, reach no log handler; any other task
  asyncio logs still does."""
  monkeypatch.setattr(sys, "unraisablehook", sys.unraisablehook)
  monkeypatch.setattr(sys, "excepthook", sys.excepthook)
  asyncio_log = logging.getLogger("asyncio")
  monkeypatch.setattr(asyncio_log, "filters", list(asyncio_log.filters))
  logged = []
  handler = logging.Handler()
  handler.emit = logged.append
  asyncio_log.addHandler(handler)
  try:
    checkpoint._quiet_leftovers()
    checkpoint._quiet_leftovers()  # a second failed restore adds nothing
    _collected_unretrieved(ValueError(
        'OUT_OF_RANGE: Error opening "zarr" driver: Error reading "step/.zarray" '
        '[tensorstore_spec=\'{"driver":"zarr"}\']'))
    _collected_unretrieved(ValueError("not a read's"))
  finally:
    asyncio_log.removeHandler(handler)
  assert [str(record.exc_info[1]) for record in logged] == ["not a read's"]
  assert "exception was never retrieved" in logged[0].getMessage()
  assert asyncio_log.filters.count(checkpoint._not_a_leftover_read) == 1


def test_the_checkpointer_quiets_only_its_noise_and_puts_the_hooks_back(tmp_path, monkeypatch):
  seen = []
  monkeypatch.setattr(sys, "unraisablehook", lambda unraisable: seen.append(unraisable.exc_value))
  monkeypatch.setattr(sys, "excepthook", lambda *args: seen.append(args[1]))
  monkeypatch.setattr(checkpoint._Quiet, "users", 0)  # as if none were open
  absl = logging.getLogger("absl")
  before = (sys.excepthook, sys.unraisablehook, list(absl.filters))
  closed = asyncio.new_event_loop()
  closed.close()

  checkpoints = Checkpoints(tmp_path / "checkpoints", config_key="test")
  try:
    for in_thread in (True, False):  # what tensorstore's callbacks meet: quiet
      _unraisable(closed, native=True, in_thread=in_thread)
    assert seen == []
    _unraisable(closed, native=False, in_thread=True)  # a Python caller's: not the checkpointer's
    unrelated = ValueError("unrelated")
    sys.excepthook(ValueError, unrelated, None)
    assert [str(e) for e in seen] == ["Event loop is closed", "unrelated"]
    assert not absl.filter(_orbax_record("Save Finalize thread failed: [Errno 28] No space "
                                         "left on device"))
    assert absl.filter(_orbax_record("something else failed"))
    assert absl.filter(logging.LogRecord("absl", logging.ERROR, "/lib/site-packages/other/x.py",
                                         1, "No space left on device", None, None))
  finally:
    checkpoints.close()
  assert (sys.excepthook, sys.unraisablehook, list(absl.filters)) == before

  read_only = Checkpoints(tmp_path / "checkpoints", read_only=True, config_key="test")
  assert (sys.excepthook, sys.unraisablehook, list(absl.filters)) == before  # saves nothing
  read_only.close()
  assert (sys.excepthook, sys.unraisablehook, list(absl.filters)) == before
