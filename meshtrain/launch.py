"""`meshtrain launch --num_processes N [--max_restarts R] -- train ...`: a multi-host job on one machine.

Starts N copies of a meshtrain command, each told the coordinator
(127.0.0.1 on a free port), the process count and its id, and prefixes their
output with `[i]` (process 0's progress bar passes through as it is).

When one exits with an error or is killed, the others are killed: none of them
can save or go on without it. With `--max_restarts R` all of them then start
again, up to R times, like torchrun; a train command resumes from its workdir's
newest complete checkpoint by itself, and each restart says which steps it
trains again. Bad input (exit 2) and a stop on purpose (3: a non-finite loss)
would fail the same way again and are not restarted. SIGTERM and Ctrl-C are
passed on to every process and end the job, restarts included.
"""

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from meshtrain.train.watchdog import EXIT_CODE as LOST_OR_HUNG, newest_checkpoint

BAD_INPUT, HALTED = 2, 3  # meshtrain.errors: ConfigError, TrainingHalted
NOT_RESTARTED = (BAD_INPUT, HALTED)


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _relay(stream, prefix: str, out) -> None:
  for line in iter(stream.readline, ""):
    if "peer ranks" not in line:  # gloo's connection chatter, one line per device pair
      out.write(prefix + line)
      out.flush()


def launch(command: list[str], num_processes: int, devices_per_process: int,
           max_restarts: int = 0, workdir: str | None = None, log_every: int = 1,
           program: list[str] | None = None) -> int:
  """Runs `meshtrain COMMAND` (`program` + `command`) in `num_processes`
  processes, again after a failure up to `max_restarts` times; returns the exit
  code of the process that failed first (0 when all succeeded; 128 + N for one
  killed by signal N, as shells say). `workdir` and `log_every` (a train
  command's) say which steps a restart trains again."""
  program = program or [sys.executable, "-m", "meshtrain.cli"]
  running: list[subprocess.Popen] = []
  signalled = []

  def forward(signum, _):
    signalled.append(signum)
    for process in running:
      with contextlib.suppress(ProcessLookupError):
        process.send_signal(signum)
  previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
  try:
    for restart in range(max_restarts + 1):
      running[:] = _start(program + command, num_processes, devices_per_process)
      failed, code = _wait(running)
      if failed is None or signalled:
        return code if code >= 0 else 128 - code
      if code in NOT_RESTARTED or restart == max_restarts:
        why = ("" if not max_restarts else "; not restarted: it would fail the same way again"
               if code in NOT_RESTARTED else f"; gave up after {max_restarts} restarts")
        print(f"\nlaunch: process {failed} {_exit_reason(code)}; stopped the others{why}",
              file=sys.stderr, flush=True)
        return code if code >= 0 else 128 - code
      print(f"\nlaunch: process {failed} {_exit_reason(code)}; stopped the others; restart "
            f"{restart + 1} of {max_restarts}{_redone(workdir, log_every)}", file=sys.stderr,
            flush=True)
    raise AssertionError("unreachable: the last attempt returns")
  finally:
    for s, handler in previous.items():
      signal.signal(s, handler)


def _start(args: list[str], num_processes: int, devices_per_process: int) -> list[subprocess.Popen]:
  port = free_port()
  processes = []
  for i in range(num_processes):
    process_args = [*args, f"--config.distributed.num_processes={num_processes}",
                    f"--config.distributed.process_id={i}",
                    f"--config.distributed.coordinator_address=127.0.0.1:{port}"]
    if devices_per_process:
      process_args.append(f"--config.simulate_devices={devices_per_process}")
    # A session of its own: `_stop` ends what a process started too (process 0's
    # coordination service), and a terminal's Ctrl-C reaches it once, through `forward`.
    process = subprocess.Popen(process_args, stdout=subprocess.PIPE, text=True, bufsize=1,
                               stderr=None if i == 0 else subprocess.PIPE, start_new_session=True)
    threading.Thread(target=_relay, args=(process.stdout, f"[{i}] ", sys.stdout), daemon=True).start()
    if i:
      threading.Thread(target=_relay, args=(process.stderr, f"[{i}] ", sys.stderr),
                       daemon=True).start()
    processes.append(process)
  return processes


def _wait(processes: list[subprocess.Popen]) -> tuple[int | None, int]:
  """(the process that failed first, its exit code) once one failed, the
  others stopped; (None, 0) once all succeeded."""
  while True:
    codes = [p.poll() for p in processes]
    failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
    if failed:
      _stop(processes)
      return failed[0]
    if all(c == 0 for c in codes):
      _stop(processes)  # what they left behind
      return None, 0
    time.sleep(0.1)


def _stop(processes: list[subprocess.Popen]) -> None:
  """Kills every process's session; a survivor cannot save without its peers."""
  for p in processes:
    with contextlib.suppress(ProcessLookupError, PermissionError):
      os.killpg(p.pid, signal.SIGKILL)
  for p in processes:
    p.wait()


def _exit_reason(code: int) -> str:
  if code < 0:
    return f"was killed by {signal.Signals(-code).name}"
  if code == LOST_OR_HUNG:
    return f"exited with code {code} (a lost peer or a hang, its line above)"
  return f"exited with code {code}"


def _redone(workdir: str | None, log_every: int) -> str:
  """Where a restarted train command resumes, and the logged steps since then
  that it loses (metrics.jsonl keeps the new run's records of them)."""
  if not workdir:
    return ""
  start = newest_checkpoint(workdir)
  logged = _last_logged_step(Path(workdir) / "metrics.jsonl")
  origin = f"from checkpoint {start}" if start is not None else "from the start"
  start = start or 0
  if logged is None or logged <= start:
    return f" {origin}, losing no logged step"
  lost = f"step {logged}" if logged == start + 1 else f"steps {start + 1}-{logged}"
  unlogged = f" (and those after step {logged} that log_every={log_every} did not log)"
  return f" {origin}, losing {lost}{unlogged if log_every > 1 else ''}"


def _last_logged_step(path: Path) -> int | None:
  steps = []
  with contextlib.suppress(OSError):
    for line in path.read_text(errors="replace").splitlines():
      with contextlib.suppress(ValueError, TypeError, KeyError):
        steps.append(int(json.loads(line)["step"]))
  return max(steps, default=None)
