"""The watchdog on its own: deadlines, peers' heartbeats through a key-value
store, the stacks file, the one line and exit code 4; and the coordination
service in a child process of process 0. Seconds each, no model."""

import io
import re
import subprocess
import sys
import threading
import time

import pytest

from conftest import REPO, micro_config
from meshtrain import distributed, validate
from meshtrain.errors import ConfigError
from meshtrain.launch import free_port
from meshtrain.train.watchdog import EXIT_CODE, Watchdog, faults, newest_checkpoint

WATCHDOG_PY = REPO / "meshtrain/train/watchdog.py"
# The module alone (it imports only the standard library), without the package's imports.
LOAD = (f"import importlib.util as u; s = u.spec_from_file_location('watchdog', {str(WATCHDOG_PY)!r}); "
        "w = u.module_from_spec(s); s.loader.exec_module(w); ")


class Store:
  """The coordination service's key-value store, in memory; `silent` keys ignore writes."""

  def __init__(self):
    self.values, self.silent, self.down = {}, set(), False
    self.lock = threading.Lock()

  def key_value_set(self, key, value, allow_overwrite=False):
    if self.down:
      raise RuntimeError("UNAVAILABLE: Failed to send RPC to coordination service")
    with self.lock:
      if key not in self.silent:
        self.values[key] = value

  def key_value_dir_get(self, prefix):
    if self.down:
      raise RuntimeError("UNAVAILABLE: Failed to send RPC to coordination service")
    with self.lock:
      return [(k, v) for k, v in self.values.items() if k.startswith(prefix)]


def dog(workdir, **options):
  codes, out = [], io.StringIO()
  watchdog = Watchdog(workdir, interval_s=0.1, exit=codes.append, out=out, **options)
  return watchdog, codes, out


def wait_for(codes, seconds=10.0):
  deadline = time.monotonic() + seconds
  while not codes and time.monotonic() < deadline:
    time.sleep(0.05)


def test_a_step_past_its_deadline_leaves_every_stack_and_one_line(tmp_path):
  (tmp_path / "checkpoints/4").mkdir(parents=True)
  (tmp_path / "checkpoints/6.orbax-checkpoint-tmp-17").mkdir()  # a save cut short
  watchdog, codes, out = dog(tmp_path, step_timeout_s=0.3)
  watchdog.start()
  watchdog.expect("step 7", 7, 0.3)
  wait_for(codes)
  watchdog.close()
  stacks = tmp_path / "hang_stacks_process0.txt"
  assert codes == [EXIT_CODE]
  assert out.getvalue().splitlines() == [
      "",  # off the line of process 0's progress bar
      f"error: distributed: step 7 did not finish in 0.3 s (a stopped peer or a stuck collective; "
      f"every thread's stack is in {stacks}); newest complete checkpoint: 4"]
  text = stacks.read_text()
  assert "test_a_step_past_its_deadline_leaves_every_stack_and_one_line" in text  # the main thread
  assert "meshtrain-watchdog" in text or "_watch" in text


def test_a_watchdog_petted_in_time_does_not_fire(tmp_path):
  watchdog, codes, out = dog(tmp_path, step_timeout_s=1.0)
  watchdog.start()
  for step in range(1, 21):
    watchdog.expect(f"step {step}", step)
    time.sleep(0.1)
  watchdog.close()
  time.sleep(1.5)  # closed: no deadline any more
  assert codes == [] and out.getvalue() == ""


def test_what_compiles_gets_the_compile_allowance(tmp_path):
  watchdog, codes, out = dog(tmp_path, step_timeout_s=0.3, compile_timeout_s=30)
  watchdog.start()
  watchdog.expect("step 1", 1, watchdog.allowance(compiles=True))  # the first step
  time.sleep(0.8)
  with watchdog.phase("evaluation at step 1", 1, watchdog.allowance(kind="evaluation", scale=2)):
    time.sleep(0.8)  # the first evaluation compiles too
  assert codes == []
  with watchdog.phase("evaluation at step 2", 2, watchdog.allowance(kind="evaluation", scale=2)):
    wait_for(codes)
  watchdog.close()
  assert codes == [EXIT_CODE]
  assert "evaluation at step 2 did not finish in 0.6 s" in out.getvalue()


def test_a_peer_whose_heartbeats_stop_is_lost_and_one_that_finished_is_not(tmp_path):
  store = Store()
  peers = [dog(tmp_path, peer_timeout_s=1.5, client=store, process_index=i, num_processes=3)
           for i in range(3)]
  for watchdog, _, _ in peers:
    watchdog.start()
    watchdog.dispatched(5, None)  # without deadlines, only the step is noted
  time.sleep(0.5)
  peers[2][0].close()  # done: its peers stop waiting for it
  store.silent.add("meshtrain/heartbeat/1")  # gone without a word
  first, codes, out = peers[0]
  wait_for(codes)
  for watchdog, _, _ in peers:
    watchdog.close()
  assert codes == [EXIT_CODE]
  line, = out.getvalue().strip().splitlines()
  assert re.fullmatch(r"error: distributed: process 1 lost at step 5 \(no heartbeat for \d+ s, "
                      r"its last at its step 5\); newest complete checkpoint: none", line), line


def test_a_peer_never_heard_from_is_lost_too(tmp_path):
  watchdog, codes, out = dog(tmp_path, peer_timeout_s=0.5, client=Store(), num_processes=2)
  watchdog.start()
  wait_for(codes)
  watchdog.close()
  assert "process 1 lost at step 0 (no heartbeat for 1 s, none received)" in out.getvalue()


def test_a_key_value_store_that_stops_answering_is_a_lost_coordinator(tmp_path):
  store = Store()
  watchdog, codes, out = dog(tmp_path, peer_timeout_s=0.5, client=store, process_index=1,
                             num_processes=2)
  store.down = True
  watchdog.start()
  wait_for(codes)
  watchdog.close()
  assert codes == [EXIT_CODE]
  assert out.getvalue().startswith("error: distributed: coordinator lost at step 0 (its "
                                   "key-value store did not answer for 1 s)")


def test_after_an_error_with_every_peer_alive_the_error_is_the_callers(tmp_path):
  store = Store()
  peers = [dog(tmp_path, peer_timeout_s=5, client=store, process_index=i, num_processes=2)[0]
           for i in range(2)]
  for watchdog in peers:
    watchdog.start()
  started = time.monotonic()
  peers[0].await_verdict()  # process 1 keeps beating: returns within a beat or two
  assert time.monotonic() - started < 2
  for watchdog in peers:
    watchdog.close()


def test_a_last_heartbeat_first_read_after_the_error_is_no_sign_of_life(tmp_path):
  """Process 1 wrote its last heartbeat just before it died, and process 0
  first reads it after its collective failed: written before the error, so
  process 0 keeps judging, and loses process 1 once its heartbeats stay still."""
  store, key = Store(), "meshtrain/heartbeat/1"
  store.values[key] = "1 5"
  watchdog, codes, out = dog(tmp_path, peer_timeout_s=0.5, client=store, num_processes=2)
  watchdog.start()
  time.sleep(0.3)  # "1 5" is read
  verdict = threading.Thread(target=watchdog.await_verdict, daemon=True)
  with store.lock:  # nothing is read until the error is being judged
    store.values[key] = "2 5"
    verdict.start()
    time.sleep(0.1)
  verdict.join(timeout=3)
  watchdog.close()
  assert verdict.is_alive()  # not judged alive: the caller's error is not raised
  assert codes == [EXIT_CODE]
  assert "error: distributed: process 1 lost at step 0" in out.getvalue()


def test_the_process_leaves_with_exit_code_4_and_one_line(tmp_path):
  script = LOAD + (f"d = w.Watchdog({str(tmp_path)!r}, step_timeout_s=0.5, interval_s=0.1).start(); "
                   "d.expect('step 3', 3, 0.5); import time; time.sleep(60)")
  started = time.monotonic()
  result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
  assert result.returncode == EXIT_CODE == 4
  assert time.monotonic() - started < 30
  assert result.stderr.splitlines() == [
      "", f"error: distributed: step 3 did not finish in 0.5 s (a stopped peer or a stuck collective; "
      f"every thread's stack is in {tmp_path}/hang_stacks_process0.txt); newest complete "
      "checkpoint: none"]


def test_a_fault_is_injected_once_per_workdir(tmp_path):
  script = LOAD + f"w.Watchdog({str(tmp_path)!r}, process_index=1).inject_fault(3)"
  env = {"MESHTRAIN_FAULT": "0:STOP:3, 1:KILL:3"}
  first, again = (subprocess.run([sys.executable, "-c", script], env=env, timeout=60)
                  for _ in range(2))
  assert (first.returncode, again.returncode) == (-9, 0)
  assert (tmp_path / "fault-1-KILL-3").is_file() and not (tmp_path / "fault-0-STOP-3").exists()
  assert faults("1:kill:5,0:STOP:9:save") == [(1, "KILL", 5, "step"), (0, "STOP", 9, "save")]
  with pytest.raises(ValueError, match="KILL or STOP"):
    faults("1:TERM:5")
  with pytest.raises(ValueError, match="only ':save'"):
    faults("1:KILL:5:eval")


def test_newest_checkpoint_counts_complete_steps_only(tmp_path):
  assert newest_checkpoint(tmp_path) is None
  for name in ("3", "12", "15.orbax-checkpoint-tmp-99"):
    (tmp_path / "checkpoints" / name).mkdir(parents=True)
  assert newest_checkpoint(tmp_path) == 12


def test_the_timeouts_of_a_job_of_one_process_are_refused():
  cfg = micro_config(**{"distributed.step_timeout_s": 60})
  with pytest.raises(ConfigError, match="config.distributed.step_timeout_s: is set to 60 but "
                                        "ignored: a job of one process has no peers"):
    validate.check_config(cfg)
  cfg = micro_config(**{"distributed.compile_timeout_s": -1, "distributed.num_processes": 0})
  with pytest.raises(ConfigError, match="config.distributed.compile_timeout_s: is -1"):
    validate.check_config(cfg)


def test_the_coordination_service_serves_from_a_child_process():
  """What process 0 runs instead of jax's in-process service: clients join,
  share keys, shut down, and `shutdown` ends the child."""
  from meshtrain.jax_internals import jax_distributed, jaxlib_runtime as _jax
  assert callable(jax_distributed._jax.get_distributed_runtime_service)  # the seam it replaces
  address = f"127.0.0.1:{free_port()}"
  service = distributed._ServiceInChild(_jax).get_distributed_runtime_service(
      address, 2, heartbeat_timeout=10, shutdown_timeout=10)
  clients = [_jax.get_distributed_runtime_client(address, i, init_timeout=20, heartbeat_timeout=10)
             for i in range(2)]
  threads = [threading.Thread(target=c.connect) for c in clients]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  clients[1].key_value_set("meshtrain/heartbeat/1", "1 0")
  assert clients[0].key_value_dir_get("meshtrain/heartbeat/") == [("meshtrain/heartbeat/1", "1 0")]
  threads = [threading.Thread(target=c.shutdown) for c in clients]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  service.shutdown()
  assert service._process.returncode == 0


def test_a_save_that_waits_for_the_disk_gets_the_save_timeout(tmp_path):
  watchdog, codes, out = dog(tmp_path, step_timeout_s=0.3, save_timeout_s=30)
  watchdog.start()
  with watchdog.phase("saving the last checkpoints", 5, watchdog.allowance(saves=True)):
    time.sleep(0.8)  # a large checkpoint on slow storage
  assert codes == []
  watchdog.expect("step 6", 6)
  wait_for(codes)
  watchdog.close()
  assert codes == [EXIT_CODE] and "step 6 did not finish in 0.3 s" in out.getvalue()
  assert dog(tmp_path, step_timeout_s=0.3)[0].allowance(saves=True) == float("inf")  # 0: no limit


def test_the_last_save_of_a_run_is_bounded_by_the_save_timeout_not_the_step_timeout(
    tmp_path, monkeypatch):
  """The loop gives its final save (orbax waiting for the disk) the save
  timeout: a save slower than a step timeout is no hang."""
  from meshtrain.checkpoint import Checkpoints
  from meshtrain.train import loop
  watchdog, codes, out = dog(tmp_path, step_timeout_s=1.5, compile_timeout_s=120,
                             save_timeout_s=60)
  monkeypatch.setattr(loop, "watchdog_for", lambda *args: watchdog.start())
  close = Checkpoints.close

  def slow_close(self):
    time.sleep(3)  # slow storage
    close(self)
  monkeypatch.setattr(Checkpoints, "close", slow_close)
  records = loop.train(micro_config(workdir=str(tmp_path / "run"), steps=3,
                                    **{"checkpoint.every_steps": 0}))
  assert [r["step"] for r in records] == [1, 2, 3]
  assert codes == [] and out.getvalue() == "", out.getvalue()
  assert newest_checkpoint(tmp_path / "run") == 3
