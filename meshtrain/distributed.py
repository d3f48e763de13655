"""One process per host: `jax.distributed` from `config.distributed`.

`num_processes=1` runs alone. `num_processes=N` with `coordinator_address` and
`process_id` starts the multi-controller runtime explicitly (what `meshtrain
launch` and the ssh example pass). `num_processes=0` leaves it to
`jax.distributed.initialize()`, which reads Slurm, Open MPI and cloud TPU
environments. On CPU the processes talk through gloo.

Losing a peer: `meshtrain.train.watchdog` notices a peer whose heartbeats stop
after `timeout_s` and ends the job in one line. JAX's own heartbeats notice it
too and end every process with a fatal-error dump from a C++ thread, which
nothing in Python can intercept, so they are the backstop and must come later.
Their timeout is `JAX_HEARTBEAT_FACTOR` times `timeout_s`: a client beats every
half of it, so the service notices a dead peer between half and all of it after
the death (measured: 10.8 to 20.2 s with a 20 s timeout), never before twice
the watchdog's `timeout_s`.

JAX's coordination service normally runs inside process 0; when that process
dies, every other one's error polling fails at once, in the same fatal way.
Here it runs in a child process of process 0 instead (`_ChildService`), so that
a dead process 0 is a lost peer like any other. When the whole host of process
0 goes away, the service goes with it and JAX's dump is what the others print.
"""

import re
import subprocess
import sys

import jax

from meshtrain.errors import ConfigError
from meshtrain.jax_internals import jax_distributed as _jax_distributed


def check(dist_cfg) -> None:
  """Raises ConfigError for settings that cannot start a job (run up front by `meshtrain.validate`)."""
  n = dist_cfg.num_processes
  if n < 0:
    raise ConfigError("config.distributed.num_processes", f"is {n}; use 1, N > 1, or 0 to detect")
  if n > 1:
    if not re.fullmatch(r"\S+:\d{1,5}", dist_cfg.coordinator_address):
      raise ConfigError("config.distributed.coordinator_address",
                        f"is {dist_cfg.coordinator_address!r}; num_processes={n} needs the "
                        "host:port of process 0")
    if not 0 <= dist_cfg.process_id < n:
      raise ConfigError("config.distributed.process_id",
                        f"is {dist_cfg.process_id}; give this process's id in 0..{n - 1}")
  if dist_cfg.timeout_s <= 0:
    raise ConfigError("config.distributed.timeout_s", f"is {dist_cfg.timeout_s}; use seconds > 0")


JAX_HEARTBEAT_FACTOR = 4  # JAX's heartbeat timeout over `timeout_s`; see the module docstring


def initialize(dist_cfg) -> None:
  """Joins the job before anything touches a device."""
  check(dist_cfg)
  n = dist_cfg.num_processes
  if n == 1:
    return
  jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU only; GPUs use NCCL
  explicit = dict(coordinator_address=dist_cfg.coordinator_address, num_processes=n,
                  process_id=dist_cfg.process_id) if n > 1 else {}
  real = _jax_distributed._jax
  _jax_distributed._jax = _ServiceInChild(real)  # what process 0 would start, started in a child
  try:
    jax.distributed.initialize(**explicit, initialization_timeout=dist_cfg.timeout_s,
                               heartbeat_timeout_seconds=JAX_HEARTBEAT_FACTOR * dist_cfg.timeout_s)
  except ValueError as error:  # no cluster found, or an inconsistent environment
    raise ConfigError("config.distributed.num_processes",
                      f"{error} (0 detects Slurm, Open MPI or TPU; elsewhere set num_processes, "
                      "coordinator_address and process_id)") from None
  finally:
    _jax_distributed._jax = real


def client():
  """The coordination service's client of this process (its key-value store),
  or None outside a job of several processes."""
  return _jax_distributed.global_state.client if jax.process_count() > 1 else None


# The coordination service in a process of its own: it serves until its parent
# writes "stop" (after every process has shut down) or, when the parent died
# without it, for one more heartbeat timeout (the others notice and stop first).
# Once serving, its log goes nowhere: what it would say (a task is unhealthy,
# errors propagated) the processes say themselves, and it may outlive process 0,
# whose last line of output stays the one line.
_SERVE = """
import os, signal, sys, time
from jaxlib import _jax
for s in (signal.SIGINT, signal.SIGTERM):  # a terminal's Ctrl-C and a scheduler's TERM are for the trainers
  signal.signal(s, signal.SIG_IGN)
address, processes, heartbeat_s, shutdown_s = sys.argv[1], *map(int, sys.argv[2:])
service = _jax.get_distributed_runtime_service(address, processes, heartbeat_timeout=heartbeat_s,
                                               shutdown_timeout=shutdown_s)
os.dup2(os.open(os.devnull, os.O_WRONLY), 2)
print("serving", flush=True)
if sys.stdin.readline().strip() != "stop":
  time.sleep(heartbeat_s)
service.shutdown()
"""


class _ChildService:
  """Stands in for `jaxlib._jax.DistributedRuntimeService` in process 0."""

  def __init__(self, address: str, num_nodes: int, *, heartbeat_timeout: int = 100,
               shutdown_timeout: int = 300, **_):
    self._process = subprocess.Popen(
        [sys.executable, "-c", _SERVE, address, str(num_nodes), str(heartbeat_timeout),
         str(shutdown_timeout)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    if self._process.stdout.readline().strip() != "serving":
      raise RuntimeError(f"the coordination service did not start on {address} (exit code "
                         f"{self._process.wait()})")

  def shutdown(self) -> None:
    """After every process's client has shut down (jax's order)."""
    if self._process.poll() is None:
      self._process.stdin.write("stop\n")
      self._process.stdin.flush()
      self._process.wait()


class _ServiceInChild:
  """jaxlib's module as `jax.distributed.initialize` sees it, with the service
  started in a child process."""

  def __init__(self, real):
    self._real = real

  def __getattr__(self, name):
    return getattr(self._real, name)

  @staticmethod
  def get_distributed_runtime_service(address, num_nodes, **options):
    return _ChildService(address, num_nodes, **options)
