"""Restarts: `meshtrain launch --max_restarts` on stand-in processes (quick),
then chaos on 2 processes x 4 simulated devices (slow): a killed process, a
stopped one, a lost coordinator, each stopped in one line and the job finished
equal to one that met no fault, bit for bit.

Faults come from `MESHTRAIN_FAULT` (meshtrain/train/watchdog.py): process K
sends itself SIGKILL or SIGSTOP before step S, or right after checkpoint S's
asynchronous save started, once per workdir.
"""

import json
import os
import re
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from conftest import REPO, micro_config, micro_flags
from meshtrain import launch, workdir as saved_run
from meshtrain.train.setup import build

# A stand-in for `meshtrain COMMAND` in 2 processes: argv[1] a folder counting
# their starts, argv[2] what each attempt does, e.g. "1:4,ok": in the first,
# process 1 exits 4 (the other waits to be stopped); in the second, both
# succeed. The failing process waits until both have started, so that a
# process stopped early still counts its start.
STAND_IN = """
import os, pathlib, signal, sys, time
i = int(next(a for a in sys.argv if a.startswith("--config.distributed.process_id=")).split("=")[1])
starts = pathlib.Path(sys.argv[1])
attempt = len(list(starts.glob(f"start-{i}-*")))
(starts / f"start-{i}-{attempt}").touch()
plan = sys.argv[2].split(",")
action = plan[min(attempt, len(plan) - 1)]
if action == "ok":
  sys.exit(0)
who, what = action.split(":")
if int(who) != i:
  time.sleep(120)
while len(list(starts.glob(f"start-*-{attempt}"))) < 2:
  time.sleep(0.01)
if what == "KILL":
  os.kill(os.getpid(), signal.SIGKILL)
sys.exit(int(what))
"""


def run_stand_ins(tmp_path, plan, max_restarts, **options):
  started = time.monotonic()
  code = launch.launch([str(tmp_path), plan], 2, 0, max_restarts,
                       program=[sys.executable, "-c", STAND_IN], **options)
  assert time.monotonic() - started < 60  # the waiting ones were stopped, not waited for
  return code, len(list(tmp_path.glob("start-0-*")))


def a_run_at(workdir, checkpoint, logged):
  (workdir / "checkpoints" / str(checkpoint)).mkdir(parents=True)
  (workdir / "checkpoints" / f"{checkpoint + 3}.orbax-checkpoint-tmp-5").mkdir()
  lines = [json.dumps({"step": s, "loss": 1.0}) for s in range(1, logged + 1)]
  (workdir / "metrics.jsonl").write_text("\n".join(lines) + '\n{"step": ')  # cut by a kill
  return str(workdir)


def test_a_failed_process_stops_the_others_and_they_all_start_again(tmp_path, capsys):
  workdir = a_run_at(tmp_path / "run", checkpoint=4, logged=7)
  assert run_stand_ins(tmp_path, "1:4,1:KILL,ok", 2, workdir=workdir) == (0, 3)
  lines = [line for line in capsys.readouterr().err.splitlines() if line]
  assert lines == [
      "launch: process 1 exited with code 4 (a lost peer or a hang, its line above); stopped the "
      "others; restart 1 of 2 from checkpoint 4, losing steps 5-7",
      "launch: process 1 was killed by SIGKILL; stopped the others; restart 2 of 2 from "
      "checkpoint 4, losing steps 5-7"]


def test_a_restart_counts_the_steps_it_loses(tmp_path):
  assert launch._redone(a_run_at(tmp_path / "a", 4, 5), 1) == " from checkpoint 4, losing step 5"
  assert launch._redone(a_run_at(tmp_path / "b", 4, 4), 1) == " from checkpoint 4, losing no logged step"
  assert launch._redone(a_run_at(tmp_path / "c", 10, 20), 10) == (
      " from checkpoint 10, losing steps 11-20 (and those after step 20 that log_every=10 did "
      "not log)")
  assert launch._redone(str(tmp_path / "new"), 1) == " from the start, losing no logged step"
  assert launch._redone(None, 1) == ""


def test_bad_input_is_not_restarted(tmp_path, capsys):
  assert run_stand_ins(tmp_path, "0:2,ok", 3) == (2, 1)
  assert capsys.readouterr().err.strip() == (
      "launch: process 0 exited with code 2; stopped the others; not restarted: it would fail "
      "the same way again")


def test_restarts_end_after_max_restarts(tmp_path, capsys):
  assert run_stand_ins(tmp_path, "1:KILL", 2) == (128 + 9, 3)
  assert capsys.readouterr().err.strip().splitlines()[-1] == (
      "launch: process 1 was killed by SIGKILL; stopped the others; gave up after 2 restarts")


# data=2 spans the two processes, fsdp=4 stays inside each; checkpoints at 3, 6, 9.
CHAOS = {"mesh.data": 2, "mesh.fsdp": 4, "steps": 9, "checkpoint.every_steps": 3}


def launched(workdir, *, max_restarts=0, fault="", timeout_s=10, step_timeout_s=300, steps=9):
  env = {**os.environ, "MESHTRAIN_FAULT": fault}
  started = time.monotonic()
  result = subprocess.run(
      [sys.executable, "-m", "meshtrain.cli", "launch", "--num_processes=2",
       "--devices_per_process=4", f"--max_restarts={max_restarts}", "--",
       "train", f"--config.workdir={workdir}", *micro_flags(**{**CHAOS, "steps": steps}),
       f"--config.distributed.timeout_s={timeout_s}",
       f"--config.distributed.step_timeout_s={step_timeout_s}"],
      capture_output=True, text=True, timeout=600, cwd=REPO, env=env)
  return result, time.monotonic() - started


def records(workdir):
  return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]


def final_params(workdir):
  setup = build(micro_config(**CHAOS))
  params = saved_run.load_params(workdir, CHAOS["steps"], setup.spec.abstract_params,
                                 setup.shardings.params)
  return jax.tree.map(np.asarray, params)


def no_dumps(text):
  return not any(s in text for s in ("Traceback", "Terminating process", "Check failure"))


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
  """The workdir of the job that met no fault."""
  workdir = tmp_path_factory.mktemp("straight")
  result, _ = launched(workdir)
  assert result.returncode == 0, result.stderr[-3000:]
  return workdir


def assert_ends_as(chaos, straight):
  """Each step logged once (the resumed run's), the losses and the final
  weights those of the job that met no fault, bit for bit."""
  got, expected = records(chaos), records(straight)
  assert [r["step"] for r in got] == list(range(1, 10))
  assert [r["loss"] for r in got] == [r["loss"] for r in expected]
  same = jax.tree.map(np.array_equal, final_params(chaos), final_params(straight))
  assert all(jax.tree.leaves(same))


@pytest.mark.slow
def test_a_job_outlives_a_killed_and_a_stopped_process_bit_for_bit(tmp_path, straight):
  """Process 1 is killed before step 5 (checkpoint 3 done, 6 not yet), and
  stopped before step 8; the job restarts twice and ends where one that met
  no fault ends."""
  chaos, _ = launched(tmp_path / "chaos", max_restarts=2, fault="1:KILL:5,1:STOP:8")
  assert chaos.returncode == 0, chaos.stderr[-3000:]

  lines = [line for line in re.split(r"[\r\n]", chaos.stderr) if line.startswith(("launch:", "error:"))]
  assert len(lines) == 3, lines
  assert re.fullmatch(r"launch: process 1 was killed by SIGKILL; stopped the others; restart 1 of "
                      r"2 from (checkpoint 3|the start), losing (no logged step|steps? .*)",
                      lines[0]), lines  # what the kill found logged is the machine's timing
  assert re.fullmatch(r"error: distributed: process 1 lost at step 8 \(no heartbeat for 1\d s, "
                      r"its last at its step [67]\); newest complete checkpoint: [36]", lines[1]), lines
  assert lines[2].startswith("launch: process 0 exited with code 4 (a lost peer or a hang, its "
                             "line above); stopped the others; restart 2 of 2 from checkpoint ")
  assert no_dumps(chaos.stderr) and no_dumps(chaos.stdout)
  assert "resumed from" in chaos.stdout and "done: step 9" in chaos.stdout
  assert_ends_as(tmp_path / "chaos", straight)


@pytest.mark.slow
def test_a_kill_during_an_asynchronous_save_loses_no_complete_checkpoint(tmp_path, straight):
  """Process 1 is killed while checkpoint 6 is being written: 6 never
  completes, the restart resumes from 3 (the newest complete), and the job
  ends where one that met no fault ends."""
  chaos, _ = launched(tmp_path / "chaos", max_restarts=1, fault="1:KILL:6:save")
  assert chaos.returncode == 0, chaos.stderr[-3000:]
  assert (tmp_path / "chaos" / "fault-1-KILL-6-save").is_file()
  lines = [line for line in re.split(r"[\r\n]", chaos.stderr) if line.startswith(("launch:", "error:"))]
  assert len(lines) == 1 and re.fullmatch(
      r"launch: process 1 was killed by SIGKILL; stopped the others; restart 1 of 1 from "
      r"checkpoint 3, losing steps? .*", lines[0]), lines
  assert no_dumps(chaos.stderr) and no_dumps(chaos.stdout)
  assert_ends_as(tmp_path / "chaos", straight)


@pytest.mark.slow
def test_a_stopped_peer_is_noticed_within_the_step_timeout_and_leaves_the_stacks(tmp_path):
  step_timeout_s = 10
  result, _ = launched(tmp_path, fault="1:STOP:3", timeout_s=120, step_timeout_s=step_timeout_s,
                       steps=6)
  stopped_at = float((tmp_path / "fault-1-STOP-3").read_text())
  assert result.returncode == 4
  assert time.time() - stopped_at < step_timeout_s + 30
  stacks = tmp_path / "hang_stacks_process0.txt"
  line, = [line for line in re.split(r"[\r\n]", result.stderr) if line.startswith("error:")]
  assert re.fullmatch(rf"error: distributed: (step 3|saving checkpoint 3) did not finish in "
                      rf"{step_timeout_s} s \(a stopped peer or a stuck collective; every "
                      rf"thread's stack is in {stacks}\); newest complete checkpoint: none", line)
  text = stacks.read_text()
  assert "meshtrain/train/loop.py" in text and " in _train" in text  # the step loop
  assert no_dumps(result.stderr)


@pytest.mark.slow
def test_when_the_coordinator_dies_the_other_process_stops_in_one_line(tmp_path):
  """Process 0 hosts the coordination service (in a child process): killed,
  it is a lost peer like any other, not a fatal error of jax's in process 1."""
  timeout_s = 10
  port = launch.free_port()
  processes = [subprocess.Popen(
      [sys.executable, "-m", "meshtrain.cli", "train", f"--config.workdir={tmp_path}",
       *micro_flags(**{**CHAOS, "steps": 10_000}), "--config.simulate_devices=4",
       "--config.distributed.num_processes=2", f"--config.distributed.process_id={i}",
       f"--config.distributed.coordinator_address=127.0.0.1:{port}",
       f"--config.distributed.timeout_s={timeout_s}"],
      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=REPO,
      env={**os.environ, "MESHTRAIN_FAULT": "0:KILL:3"}) for i in range(2)]
  _, stderr = processes[1].communicate(timeout=300)
  killed_at = float((tmp_path / "fault-0-KILL-3").read_text())
  processes[0].wait(timeout=60)
  assert (processes[0].returncode, processes[1].returncode) == (-9, 4)
  assert time.time() - killed_at < timeout_s + 30
  lines = [line for line in stderr.splitlines() if line.strip() and "peer ranks" not in line]
  assert len(lines) == 1 and re.fullmatch(
      r"error: distributed: process 0 lost at step 3 \(no heartbeat for 1\d s, its last at its "
      r"step [123]\); newest complete checkpoint: none", lines[0]), stderr[-3000:]
