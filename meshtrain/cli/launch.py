"""`meshtrain launch`: N local processes started as N hosts of one job, each
running the command after `--`; the command's flags and config are checked
here once, before any process starts."""

import sys

from absl import flags

from meshtrain import launch as launcher, validate
from meshtrain.cli import (common, evaluate, export_hf, generate, import_hf, train, usage,
                           verify)
from meshtrain.errors import ConfigError

FLAGS = flags.FlagValues()
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", 2, "processes to start", flag_values=FLAGS)
_DEVICES_PER_PROCESS = flags.DEFINE_integer(
    "devices_per_process", 0, "simulated CPU devices per process (0: the config's)",
    flag_values=FLAGS)
_MAX_RESTARTS = flags.DEFINE_integer(
    "max_restarts", 0, "when a process fails, stop the others and start them all again "
    "(train resumes from its newest checkpoint), up to this many times; bad input (exit 2) is "
    "not restarted", flag_values=FLAGS)

# The commands launch starts: those that join a job.
LAUNCHED = {command.name: command for command in (train.COMMAND, evaluate.COMMAND,
                                                  verify.COMMAND, generate.COMMAND,
                                                  import_hf.COMMAND, export_hf.COMMAND)}
MAX_PROCESSES = 64
DISTRIBUTED_KEYS = ("num_processes", "process_id", "coordinator_address")  # launch sets them


def main(argv: list[str]) -> None:
  command = argv[1:]
  if not command or command[0] not in usage.SUMMARIES or command[0] in ("launch", "help"):
    raise ConfigError("launch", "give the command after --, e.g. "
                      "`meshtrain launch --num_processes 2 -- train --config configs/tiny.py`")
  if command[0] not in LAUNCHED:
    raise ConfigError("launch", f"{command[0]} runs in one process and joins no job; run "
                      f"`meshtrain {command[0]}` itself (launch runs {', '.join(LAUNCHED)})")
  num_processes, devices_per_process = _NUM_PROCESSES.value, _DEVICES_PER_PROCESS.value
  if not 1 <= num_processes <= MAX_PROCESSES:
    raise ConfigError("--num_processes", f"is {num_processes}; start 1 to {MAX_PROCESSES} "
                      "processes (all of them on this machine)")
  # 0 keeps the config's own count
  common.check_as_config("--devices_per_process", "simulate_devices", devices_per_process)
  max_restarts = _MAX_RESTARTS.value
  if max_restarts < 0:
    raise ConfigError("--max_restarts", f"is {max_restarts}; give 0 (none) or more")
  cfg = _check_launched(LAUNCHED[command[0]], command, num_processes, devices_per_process)
  sys.exit(launcher.launch(command, num_processes, devices_per_process, max_restarts,
                           workdir=cfg.workdir if command[0] == "train" else None,
                           log_every=cfg.log_every))


def _check_launched(launched: common.Command, command: list[str], num_processes: int,
                    devices_per_process: int):
  """The launched command's flags and config, checked here once rather than
  failing in every process after they have joined; returns the config."""
  rest = common.parse(launched, command)
  common.refuse_config_file(launched, command)
  if len(rest) > 1:
    raise ConfigError(launched.name, f"unexpected argument {rest[1]!r} after `launch -- "
                      f"{launched.name}`; flags start with -- (a config file is --config FILE)")
  for name in DISTRIBUTED_KEYS:
    key, given = f"config.distributed.{name}", launched.flag_values
    if key in given and given[key].present:
      raise ConfigError(key, "is set by launch for each process; "
                        "remove it (--num_processes before -- sets the count)")
  cfg = launched.before_launch(dict(num_processes=num_processes, process_id=0,
                                    coordinator_address="127.0.0.1:1"))  # as each process gets
  cfg.simulate_devices = devices_per_process or cfg.simulate_devices
  if cfg.simulate_devices:
    validate.check_devices(cfg, cfg.simulate_devices * num_processes)
  return cfg


COMMAND = common.Command("launch", FLAGS, main, positional=True)
