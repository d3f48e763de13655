"""One process per host: `jax.distributed` from `config.distributed`.

`num_processes=1` runs alone. `num_processes=N` with `coordinator_address` and
`process_id` starts the multi-controller runtime explicitly (what `meshtrain
launch` and the ssh example pass). `num_processes=0` leaves it to
`jax.distributed.initialize()`, which reads Slurm, Open MPI and cloud TPU
environments. On CPU the processes talk through gloo.
"""

import re

import jax

from meshtrain.errors import ConfigError


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


def initialize(dist_cfg) -> None:
  """Joins the job before anything touches a device."""
  check(dist_cfg)
  n = dist_cfg.num_processes
  if n == 1:
    return
  jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU only; GPUs use NCCL
  explicit = dict(coordinator_address=dist_cfg.coordinator_address, num_processes=n,
                  process_id=dist_cfg.process_id) if n > 1 else {}
  try:
    jax.distributed.initialize(**explicit, initialization_timeout=dist_cfg.timeout_s,
                               heartbeat_timeout_seconds=dist_cfg.timeout_s)
  except ValueError as error:  # no cluster found, or an inconsistent environment
    raise ConfigError("config.distributed.num_processes",
                      f"{error} (0 detects Slurm, Open MPI or TPU; elsewhere set num_processes, "
                      "coordinator_address and process_id)") from None
