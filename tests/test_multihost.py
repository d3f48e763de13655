"""Several processes on one machine, as on several hosts: `meshtrain launch` and jax.distributed.

Two processes of 4 simulated CPU devices each (gloo collectives) against one
process of 8 devices.
"""

import json
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from conftest import REPO, micro_config, micro_flags
from meshtrain import distributed
from meshtrain.errors import ConfigError
from meshtrain.launch import free_port
from meshtrain.mesh import host_split
from meshtrain.train.loop import train

# data=2 spans the two processes, fsdp=4 stays inside each.
CHANGES = {"mesh.data": 2, "mesh.fsdp": 4, "steps": 6, "checkpoint.every_steps": 3}


def logged_losses(workdir):
  lines = (workdir / "metrics.jsonl").read_text().splitlines()
  return {r["step"]: r["loss"] for r in map(json.loads, lines)}


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
  workdir = tmp_path_factory.mktemp("two_processes")
  result = subprocess.run(
      [sys.executable, "-m", "meshtrain.cli", "launch", "--num_processes=2",
       "--devices_per_process=4", "--", "train", f"--config.workdir={workdir}",
       *micro_flags(**CHANGES)],
      capture_output=True, text=True, timeout=400, cwd=REPO)
  assert result.returncode == 0, result.stderr[-3000:]
  return workdir, result.stdout


@pytest.mark.slow
def test_two_processes_train_like_one_process_of_eight_devices(two_processes, tmp_path):
  workdir, stdout = two_processes
  assert "[0] process 0 of 2: devices [0, 1, 2, 3], batch rows range(0, 8)" in stdout
  assert "[1] process 1 of 2: devices" in stdout and "batch rows range(8, 16)" in stdout
  expected = {r["step"]: r["loss"] for r in train(micro_config(**CHANGES, workdir=str(tmp_path)))}
  got = logged_losses(workdir)
  assert list(got) == list(expected)
  np.testing.assert_allclose(list(got.values()), list(expected.values()), rtol=1e-5)


@pytest.mark.slow
def test_a_checkpoint_of_two_processes_continues_in_one(two_processes, tmp_path):
  workdir, _ = two_processes
  cfg = micro_config(**CHANGES, workdir=str(tmp_path))
  cfg.checkpoint.restore_from = str(workdir / "checkpoints/3")
  resumed = {r["step"]: r["loss"] for r in train(cfg)}
  two = logged_losses(workdir)
  assert list(resumed) == [4, 5, 6]
  np.testing.assert_allclose([resumed[s] for s in resumed], [two[s] for s in resumed], rtol=1e-5)


PEER_LOST = ("another task died", "tasks have crashed", "crashed unexpectedly",
             "Connection closed by peer", "peer closed connection", "send connection has failed")


@pytest.mark.slow
def test_when_one_process_dies_the_other_exits_with_a_clear_error(tmp_path):
  timeout_s = 10
  port = free_port()
  processes = [subprocess.Popen(
      [sys.executable, "-m", "meshtrain.cli", "train", f"--config.workdir={tmp_path}",
       *micro_flags(**{**CHANGES, "steps": 10_000}), "--config.simulate_devices=4",
       "--config.distributed.num_processes=2", f"--config.distributed.process_id={i}",
       f"--config.distributed.coordinator_address=127.0.0.1:{port}",
       f"--config.distributed.timeout_s={timeout_s}"],
      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=REPO) for i in range(2)]
  deadline = time.monotonic() + 300
  metrics = tmp_path / "metrics.jsonl"
  while not metrics.exists() or len(metrics.read_text().splitlines()) < 3:
    assert time.monotonic() < deadline and processes[0].poll() is None
    time.sleep(0.1)
  processes[1].kill()
  killed_at = time.monotonic()
  _, stderr = processes[0].communicate(timeout=timeout_s + 60)
  assert processes[0].returncode == 4, stderr[-3000:]
  assert time.monotonic() - killed_at < timeout_s + 30
  # One line, whatever the survivor was doing (its heartbeat, or a collective
  # over the closed connection); none of jax's messages or dumps.
  errors = [line for line in stderr.splitlines() if "error" in line.lower()]
  assert len(errors) == 1 and errors[0].startswith("error: distributed: process 1 lost at step "), \
      stderr[-3000:]
  assert not any(message in stderr for message in PEER_LOST + ("Traceback", "Terminating")), \
      stderr[-3000:]


@pytest.mark.slow
def test_a_sigterm_to_one_process_stops_both_at_the_same_step_between_logging_steps(tmp_path):
  """Only process 1 gets the signal; they agree through the key-value store
  within three steps, not at the next logging step (1000 steps on), and save
  there together."""
  port = free_port()
  processes = [subprocess.Popen(
      [sys.executable, "-m", "meshtrain.cli", "train", f"--config.workdir={tmp_path}",
       *micro_flags(**{**CHANGES, "steps": 10_000, "checkpoint.every_steps": 0}),
       "--config.log_every=1000", "--config.simulate_devices=4",
       "--config.distributed.num_processes=2", f"--config.distributed.process_id={i}",
       f"--config.distributed.coordinator_address=127.0.0.1:{port}"],
      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO) for i in range(2)]
  deadline = time.monotonic() + 300
  metrics = tmp_path / "metrics.jsonl"
  while not metrics.exists() or not metrics.read_text().strip():  # step 1 logged: compiled
    assert time.monotonic() < deadline and all(p.poll() is None for p in processes)
    time.sleep(0.1)
  time.sleep(2)
  processes[1].send_signal(signal.SIGTERM)
  outputs = [p.communicate(timeout=120) for p in processes]
  assert [p.returncode for p in processes] == [0, 0], outputs[0][1][-2000:] + outputs[1][1][-2000:]
  stopped = re.search(r"SIGTERM \(another process\): stopped after step (\d+)", outputs[0][0])
  assert stopped, outputs[0][0][-2000:]
  step = int(stopped.group(1))
  assert step % 1000 and [p.name for p in (tmp_path / "checkpoints").iterdir()] == [str(step)]


# A process of a job that only joins it and waits (JAX's heartbeats, no watchdog).
_JOIN = """
import sys, time
from ml_collections import ConfigDict
from meshtrain import distributed
distributed.initialize(ConfigDict(dict(num_processes=2, process_id=int(sys.argv[1]),
                                       coordinator_address=sys.argv[2], timeout_s=int(sys.argv[3]))))
print("joined", flush=True)
time.sleep(600)
"""


@pytest.mark.slow
def test_jax_notices_a_dead_peer_well_after_the_watchdog_would():
  """JAX's fatal-error dump is the backstop: a survivor that only JAX watches
  dies of it no sooner than twice `timeout_s` after its peer, where the
  watchdog stops it after `timeout_s` and a heartbeat. Four jobs, their peers
  killed a quarter of JAX's heartbeat period (half its timeout) apart."""
  timeout_s, jobs = 2, []
  for _ in range(4):
    port = free_port()
    jobs.append([subprocess.Popen(
        [sys.executable, "-c", _JOIN, str(i), f"127.0.0.1:{port}", str(timeout_s)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO) for i in range(2)])
  for processes in jobs:
    assert all(p.stdout.readline().strip() == "joined" for p in processes)
  period_s = distributed.JAX_HEARTBEAT_FACTOR * timeout_s / 2
  killed_at = []
  for processes in jobs:
    processes[1].kill()
    killed_at.append(time.monotonic())
    time.sleep(period_s / len(jobs))
  lived_s = [None] * len(jobs)
  while None in lived_s and time.monotonic() - killed_at[0] < 60:
    for j, (survivor, _) in enumerate(jobs):
      if lived_s[j] is None and survivor.poll() is not None:
        lived_s[j] = time.monotonic() - killed_at[j]
    time.sleep(0.05)
  for survivor, _ in jobs:
    survivor.kill()
    assert "another task died" in survivor.communicate()[1]
  assert min(lived_s) >= 1.5 * timeout_s, lived_s


def test_processes_split_over_the_axes_named_across_hosts():
  sizes = {"data": 2, "pipeline": 4, "fsdp": 4, "sequence": 1, "tensor": 1}
  assert host_split(sizes, ["data"], 2)["data"] == 2
  split = host_split(sizes, ["data", "pipeline"], 8)
  assert (split["data"], split["pipeline"], split["fsdp"]) == (2, 4, 1)
  with pytest.raises(ConfigError, match="config.mesh.across_hosts: 4 processes cannot split "
                                        "over data=2"):
    host_split(sizes, ["data"], 4)
  with pytest.raises(ConfigError, match="'hosts' is not a mesh axis"):
    host_split(sizes, ["hosts"], 2)


@pytest.mark.parametrize("changes, key", [
    ({"num_processes": 2, "process_id": 0}, "config.distributed.coordinator_address"),
    ({"num_processes": 2, "coordinator_address": "127.0.0.1:1234"}, "config.distributed.process_id"),
    ({"num_processes": -3}, "config.distributed.num_processes"),
])
def test_an_incomplete_distributed_config_names_the_key(changes, key):
  cfg = micro_config()
  cfg.distributed.update(changes)
  with pytest.raises(ConfigError) as error:
    distributed.initialize(cfg.distributed)
  assert error.value.key == key
