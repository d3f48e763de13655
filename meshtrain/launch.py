"""`meshtrain launch --num_processes N -- train ...`: a multi-host job on one machine.

Starts N copies of a meshtrain command, each told the coordinator
(127.0.0.1 on a free port), the process count and its id, and prefixes their
output with `[i]` (process 0's progress bar passes through as it is). When one
exits with an error the others are stopped: a job whose peer died cannot make
progress. SIGTERM and Ctrl-C are passed on to every process.
"""

import signal
import socket
import subprocess
import sys
import threading
import time

GRACE_S = 20  # after an error or a signal: time the others get before they are killed


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _relay(stream, prefix: str, out) -> None:
  for line in iter(stream.readline, ""):
    if "peer ranks" not in line:  # gloo's connection chatter, one line per device pair
      out.write(prefix + line)
      out.flush()


def launch(command: list[str], num_processes: int, devices_per_process: int) -> int:
  """Runs `meshtrain COMMAND` in `num_processes` processes; the first non-zero exit code wins."""
  port = free_port()
  processes = []
  for i in range(num_processes):
    args = [sys.executable, "-m", "meshtrain.cli", *command,
            f"--config.distributed.num_processes={num_processes}",
            f"--config.distributed.process_id={i}",
            f"--config.distributed.coordinator_address=127.0.0.1:{port}"]
    if devices_per_process:
      args.append(f"--config.simulate_devices={devices_per_process}")
    process = subprocess.Popen(args, stdout=subprocess.PIPE, text=True, bufsize=1,
                               stderr=None if i == 0 else subprocess.PIPE)
    threading.Thread(target=_relay, args=(process.stdout, f"[{i}] ", sys.stdout), daemon=True).start()
    if i:
      threading.Thread(target=_relay, args=(process.stderr, f"[{i}] ", sys.stderr),
                       daemon=True).start()
    processes.append(process)

  def forward(signum, _):
    for process in processes:
      process.send_signal(signum)
  previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
  try:
    return _wait(processes)
  finally:
    for s, handler in previous.items():
      signal.signal(s, handler)


def _wait(processes: list[subprocess.Popen]) -> int:
  while True:
    codes = [p.poll() for p in processes]
    failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
    if failed:
      i, code = failed[0]
      print(f"launch: process {i} exited with code {code}; stopping the others", file=sys.stderr)
      _stop(processes)
      return code
    if all(c == 0 for c in codes):
      return 0
    time.sleep(0.1)


def _stop(processes: list[subprocess.Popen]) -> None:
  for p in processes:
    if p.poll() is None:
      p.terminate()
  deadline = time.monotonic() + GRACE_S
  for p in processes:
    try:
      p.wait(max(deadline - time.monotonic(), 0.1))
    except subprocess.TimeoutExpired:
      p.kill()
