"""What the commands share: a command's description (`Command`), the config
checked and joined on its devices, a saved run's config (`SavedRun`), and the
routing that makes every failure one `error: <key>: ...` line (exit 2; a
failed disk's at once, 3 for a halted run)."""

import dataclasses
import errno
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

import jax
from absl import app, flags

import meshtrain.config
from meshtrain import distributed, validate, workdir as saved_run
from meshtrain.checkpoint import storage_error
from meshtrain.cli import flag_parsing
from meshtrain.errors import ConfigError, StorageError, TrainingHalted


@dataclasses.dataclass(frozen=True)
class Command:
  """One command: its flags (`flag_values`, none of another command's) and
  `main(argv)`, and what the shared routing needs to know of it."""
  name: str
  flag_values: flags.FlagValues
  main: Callable[[list[str]], None]
  config: flag_parsing.ConfigFlag | None = None
  positional: bool = False  # takes positional arguments (launch's command, prepare's inputs)
  # (flag, path, whether it writes there) for the paths its flags name that it
  # reads or writes past its own checks: an OSError in one names the flag.
  paths: Callable[[], list[tuple[str, str | None, bool]]] = lambda: []
  # The workdir of the job it runs (train): an OSError there is the disk failing.
  job_workdir: Callable[[], Path] | None = None
  # For a command `meshtrain launch` starts: its flags and config checked once,
  # as each process will see them with `distributed` set, before any starts;
  # returns the config.
  before_launch: Callable[[dict], Any] | None = None


def parse(command: Command, argv: list[str]) -> list[str]:
  """`command`'s flags parsed from `argv` (its name first), each bad one an
  `error:` line; the config file named where none is given."""
  if command.config:
    argv = flag_parsing.with_config(argv, meshtrain.config.__file__)
  try:
    return flag_parsing.parse(argv, command.flag_values, command.config, command.name)
  except ConfigError as error:
    fail(error)


def run(command: Command, argv: list[str]) -> None:
  """`command` as an absl program on `argv` (its name first)."""
  app.run(_guarded(command, argv), argv=[f"meshtrain {command.name}", *argv[1:]],
          flags_parser=lambda given: parse(command, [command.name, *given[1:]]))


def refuse_config_file(command: Command, argv: list[str]) -> None:
  """A `--config` file given to a command that reads a saved run's config."""
  own = argv[:argv.index("--")] if "--" in argv else argv
  if (command.config and not command.config.reads_file
      and any(re.match(r"--?config(=|$)", arg) for arg in own)):
    raise ConfigError("--config", f"is not read by `meshtrain {command.name}`, so it would do "
                      "nothing; remove it (it reads the run's saved config; change its keys "
                      "with --config.KEY=VALUE)")


def _guarded(command: Command, given: list[str]):
  def main(argv):
    try:
      refuse_config_file(command, given)
      if not command.positional and len(argv) > 1:
        raise ConfigError(command.name, f"unexpected argument {argv[1]!r}; flags start "
                          f"with -- (a config file is --config {argv[1]})")
      command.main(argv)
    except StorageError as error:
      fail(error, at_once=True)
    except ConfigError as error:
      fail(error)
    except TrainingHalted as error:
      print(f"stopped: {error}", file=sys.stderr)
      sys.exit(3)
    except OSError as error:
      failure = _os_failure(command, error)
      if failure is None:  # in no path a flag names: its own traceback says where
        raise
      fail(failure, at_once=isinstance(failure, StorageError))
  return main


def _os_failure(command: Command, error: OSError) -> ConfigError | None:
  """`error` as one line naming the flag whose path it happened in, or None.
  Only a job's workdir is the disk of a running job (StorageError): train
  reads its inputs when it starts, each with its own check, so an error that
  names no file (a write to an open file) is a write there."""
  reason = error.strerror or str(error)
  paths = [p for p in (error.filename, error.filename2) if isinstance(p, (str, bytes, os.PathLike))]
  if command.job_workdir:
    workdir = command.job_workdir()
    if not paths or any(_within(path, workdir) for path in paths):
      return storage_error("config.workdir", f"writing into {workdir}", reason,
                           workdir / "checkpoints")
  # These only come from writing (shutil names the source file first).
  writing = error.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EFBIG)
  for path in paths:
    for flag, place, writes in command.paths():
      if place and (writes or not writing) and _within(path, place):
        return ConfigError(flag, f"{'writing' if writes else 'reading'} {os.fsdecode(path)} "
                           f"failed ({reason})")
  return None


def _within(path, folder) -> bool:
  """Whether `path` is `folder` or inside it."""
  path, folder = (os.path.abspath(os.fsdecode(p)) for p in (path, folder))
  return os.path.commonpath([path, folder]) == folder


def fail(error: ConfigError, at_once: bool = False) -> NoReturn:
  print(f"error: {error}", file=sys.stderr, flush=True)
  if at_once:  # a failed disk: skip exit-time cleanups that would fail on it too
    sys.stdout.flush()
    os._exit(2)
  sys.exit(2)


def use_simulated_devices(cfg) -> None:
  """Must run before anything touches a device (imports do not)."""
  if cfg.simulate_devices:
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", cfg.simulate_devices)


def joined(cfg) -> None:
  """Simulated devices set up, the job joined, and `cfg` checked against the
  devices present."""
  use_simulated_devices(cfg)
  distributed.initialize(cfg.distributed)
  validate.check_devices(cfg, jax.device_count(), jax.devices()[0].platform)


def checked_config(config: flag_parsing.ConfigFlag, writes_workdir: bool = False):
  """`--config` after `validate.check_config` (and `check_workdir` for a command that writes)."""
  cfg = config.value
  validate.check_config(cfg)
  if writes_workdir:
    validate.check_workdir(cfg)
  return cfg


def joined_config(config: flag_parsing.ConfigFlag, writes_workdir: bool = False):
  """The checked config of a command that runs on devices, `joined`."""
  cfg = checked_config(config, writes_workdir)
  joined(cfg)
  return cfg


def as_launched(cfg, distributed_settings: dict):
  """`cfg` as `meshtrain launch` hands it to each process, checked."""
  cfg.distributed.update(distributed_settings)
  validate.check_config(cfg)
  return cfg


def check_as_config(flag: str, key: str, value, fix: str = "") -> None:
  """`value`, given by `flag`, by the rule of the config key it sets
  (`validate.RULES[key]`); `fix` ends the message."""
  problem = value is not None and validate.RULES[key](value)
  if problem:
    raise ConfigError(flag, f"{problem} (as config.{key}){fix}")


@dataclasses.dataclass(frozen=True)
class SavedRun:
  """`--workdir` and `--step` of a command that reads a run's checkpoint:
  the run's saved config with the `--config.KEY=VALUE` overrides given."""
  config: flag_parsing.ConfigFlag
  workdir: flags.FlagHolder
  step: flags.FlagHolder

  @classmethod
  def define(cls, flag_values: flags.FlagValues) -> "SavedRun":
    return cls(flag_parsing.define_config(flag_values, reads_file=False),
               flags.DEFINE_string("workdir", None, "the run's workdir (its saved config; "
                                   "--config.KEY=VALUE flags change it, e.g. the mesh)",
                                   flag_values=flag_values),
               flags.DEFINE_integer("step", None, "the checkpoint step (default: the newest)",
                                    flag_values=flag_values))

  def checked(self):
    """The checked config of --workdir and its checkpoint step --step."""
    if not self.workdir.value:
      raise ConfigError("--workdir", "give the workdir of a run (or of import-hf)")
    cfg = saved_run.load_config(self.workdir.value, self.config.overrides())
    validate.check_config(cfg)
    return cfg, saved_run.checkpoint_step(self.workdir.value, self.step.value)

  def joined(self):
    """`checked`, `joined` on the devices."""
    cfg, step = self.checked()
    joined(cfg)
    return cfg, step
