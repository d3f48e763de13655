"""`meshtrain COMMAND [--flags]`: one absl program per command.

  meshtrain train --config configs/tiny.py --config.steps=300 --config.mesh.data=8
  meshtrain launch --num_processes 2 --devices_per_process 4 -- train --config configs/tiny.py
"""

import json
import os
import sys
from pathlib import Path
from typing import NoReturn

import jax
from absl import app, flags, logging
from ml_collections import config_flags

import meshtrain.config
from meshtrain import distributed, flag_parsing, launch, validate
from meshtrain.analysis.plan import format_plan, plan
from meshtrain.checkpoint import storage_error
from meshtrain.errors import ConfigError, StorageError, TrainingHalted
from meshtrain.parallel.pipeline import draw, schedule as schedules
from meshtrain.train.loop import train

# The args ml_collections reads the --config.KEY overrides from: this command's
# own, set by `_parse_flags` (not sys.argv, which holds launch's command after --
# and is read at import when --config is not named).
_OVERRIDE_ARGV: list[str] = []
_CONFIG = config_flags.DEFINE_config_file(
    "config", default=meshtrain.config.__file__,
    help_string="A config file with get_config(); `file.py:arg` passes arg. "
                "Override any key with --config.KEY=VALUE.",
    lock_config=True, sys_argv=_OVERRIDE_ARGV)
_JSON = flags.DEFINE_bool("json", False, "plan: print JSON instead of tables")
_COMPILE = flags.DEFINE_bool("compile", False, "plan: also compile the step and read its memory "
                             "and collectives (on --devices simulated CPU devices if set)")
_DEVICES = flags.DEFINE_integer("devices", None, "plan: devices to plan for (default: the "
                                "config's simulate_devices, else the devices present)")
_STAGES = flags.DEFINE_integer("stages", 4, "schedule: pipeline stages")
_MICROBATCHES = flags.DEFINE_integer("microbatches", 8, "schedule: microbatches per step")
_SCHEDULE = flags.DEFINE_enum("schedule", "1f1b", schedules.SCHEDULE_NAMES, "schedule: which one")
_VIRTUAL = flags.DEFINE_integer("virtual", 1, "schedule: model chunks per stage (interleaved)")
_BACKWARD_COST = flags.DEFINE_float("backward_cost", 2.0,
                                    "schedule: cost of a backward, a forward costing 1")
_OUT = flags.DEFINE_string("out", None, "schedule: write a Gantt chart PNG here")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", 2, "launch: processes to start")
_DEVICES_PER_PROCESS = flags.DEFINE_integer(
    "devices_per_process", 0, "launch: simulated CPU devices per process (0: the config's)")


def _use_simulated_devices(cfg) -> None:
  """Must run before anything touches a device (imports do not)."""
  if cfg.simulate_devices:
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", cfg.simulate_devices)


def checked_config(writes_workdir: bool = False):
  """`--config` after `validate.check_config` (and `check_workdir` for a command that writes)."""
  cfg = _CONFIG.value
  validate.check_config(cfg)
  if writes_workdir:
    validate.check_workdir(cfg)
  return cfg


def joined_config(writes_workdir: bool = False):
  """The checked config of a command that runs on devices: simulated devices set
  up, the job joined, and the config checked against the devices present."""
  cfg = checked_config(writes_workdir)
  _use_simulated_devices(cfg)
  distributed.initialize(cfg.distributed)
  validate.check_devices(cfg, jax.device_count(), jax.devices()[0].platform)
  return cfg


def train_command(argv: list[str]) -> None:
  del argv
  logging.set_verbosity(logging.WARNING)  # keep the terminal to the progress bar
  cfg = joined_config(writes_workdir=True)
  records = train(cfg)
  if jax.process_index():
    return
  if not records:
    print(f"nothing to do: {cfg.workdir} is already at config.steps={cfg.steps}")
  elif records[-1]["step"] == cfg.steps:
    print(f"done: step {records[-1]['step']}, loss {records[-1]['loss']:.4f}, "
          f"metrics in {Path(cfg.workdir) / 'metrics.jsonl'}")


def plan_command(argv: list[str]) -> None:
  del argv
  logging.set_verbosity(logging.WARNING)
  cfg = checked_config()
  if _DEVICES.value is not None and _DEVICES.value < 1:
    raise ConfigError("--devices", f"is {_DEVICES.value}; give the number of devices to plan for")
  if _COMPILE.value and _DEVICES.value:
    cfg.simulate_devices = _DEVICES.value
  _use_simulated_devices(cfg)
  devices = _DEVICES.value or cfg.simulate_devices or jax.device_count()
  validate.check_devices(cfg, devices, jax.devices()[0].platform if _COMPILE.value else None)
  report = plan(cfg, devices, _COMPILE.value)
  print(json.dumps(report, indent=2) if _JSON.value else format_plan(report))


def schedule_command(argv: list[str]) -> None:
  del argv
  if not 0 < _BACKWARD_COST.value < float("inf"):
    raise ConfigError("--backward_cost", f"is {_BACKWARD_COST.value}; give a positive number")
  if _OUT.value and not Path(_OUT.value).absolute().parent.is_dir():
    raise ConfigError("--out", f"folder {Path(_OUT.value).absolute().parent} does not exist; "
                      "create it or write the chart elsewhere")
  try:
    table = schedules.build(_SCHEDULE.value, _STAGES.value, _MICROBATCHES.value, _VIRTUAL.value)
  except ValueError as error:
    raise ConfigError("--schedule/--stages/--microbatches/--virtual", str(error)) from None
  summary = schedules.describe(table, 1.0, _BACKWARD_COST.value)
  if _OUT.value:
    try:
      draw.draw_gantt(table, _OUT.value, 1.0, _BACKWARD_COST.value)
    except OSError as error:
      raise ConfigError("--out", f"cannot write {_OUT.value} ({error.strerror or error}); "
                        "write the chart elsewhere") from None
    summary["chart"] = _OUT.value
  if _JSON.value:
    print(json.dumps(summary, indent=2))
    return
  print(schedules.to_text(table))
  print(f"\nbubble fraction {summary['bubble_fraction']:.4f} "
        f"(ideal {summary['ideal_bubble_fraction']:.4f}, backward costs {_BACKWARD_COST.value}x "
        f"a forward); stash slots per stage {summary['stash_slots']}; "
        f"peak in-flight microbatches per stage {summary['peak_in_flight']}")
  if _OUT.value:
    print(f"chart: {_OUT.value}")


def launch_command(argv: list[str]) -> None:
  command = argv[1:]
  if not command or command[0] not in COMMANDS or command[0] == "launch":
    raise ConfigError("launch", "give the command after --, e.g. "
                      "`meshtrain launch --num_processes 2 -- train --config configs/tiny.py`")
  num_processes, devices_per_process = _NUM_PROCESSES.value, _DEVICES_PER_PROCESS.value
  if num_processes < 1:
    raise ConfigError("--num_processes", f"is {num_processes}; start 1 or more processes")
  if devices_per_process < 0:
    raise ConfigError("--devices_per_process", f"is {devices_per_process}; give 0 (the config's "
                      "simulate_devices) or a number of simulated CPU devices")
  _check_launched(command, num_processes, devices_per_process)
  sys.exit(launch.launch(command, num_processes, devices_per_process))


def _check_launched(command: list[str], num_processes: int, devices_per_process: int) -> None:
  """The launched command's flags and config, checked here once rather than
  failing in every process after they have joined."""
  argv = flag_parsing.with_config(command, meshtrain.config.__file__)
  _parse_flags([f"meshtrain {argv[0]}", *argv[1:]])
  cfg = checked_config(writes_workdir=argv[0] == "train")
  cfg.distributed.update(num_processes=num_processes, process_id=0,
                         coordinator_address="127.0.0.1:1")  # what launch passes each process
  cfg.simulate_devices = devices_per_process or cfg.simulate_devices
  if cfg.simulate_devices:
    validate.check_devices(cfg, cfg.simulate_devices * num_processes)


COMMANDS = {"train": train_command, "plan": plan_command, "schedule": schedule_command,
            "launch": launch_command}


def _guarded(command):
  def main(argv):
    try:
      if command is not launch_command and len(argv) > 1:
        raise ConfigError(argv[0].split()[-1], f"unexpected argument {argv[1]!r}; flags start "
                          f"with -- (a config file is --config {argv[1]})")
      command(argv)
    except StorageError as error:
      _fail(error, at_once=True)
    except ConfigError as error:
      _fail(error)
    except TrainingHalted as error:
      print(f"stopped: {error}", file=sys.stderr)
      sys.exit(3)
    except OSError as error:  # the disk, mid-run: full, read-only or removed under the run
      workdir = Path(_CONFIG.value.workdir)
      _fail(storage_error("config.workdir", f"writing into {workdir}", error.strerror or str(error),
                          workdir / "checkpoints"), at_once=True)
  return main


def _fail(error: ConfigError, at_once: bool = False) -> NoReturn:
  print(f"error: {error}", file=sys.stderr, flush=True)
  if at_once:  # a failed disk: skip exit-time cleanups that would fail on it too
    sys.stdout.flush()
    os._exit(2)
  sys.exit(2)


def _parse_flags(argv: list[str]) -> list[str]:
  """absl's flag parsing, with each bad flag reported as one `error:` line (exit 2)."""
  try:
    return flag_parsing.parse(argv, _CONFIG, _OVERRIDE_ARGV)
  except ConfigError as error:
    _fail(error)


def run(argv: list[str] | None = None) -> None:
  """The `meshtrain` console script; `argv` (default sys.argv[1:]) starts with the command."""
  argv = sys.argv[1:] if argv is None else list(argv)
  if not argv or argv[0] not in COMMANDS:
    given = f"{argv[0]!r} is not a command" if argv else "no command given"
    _fail(ConfigError("command", f"{given}; use meshtrain {{{'|'.join(COMMANDS)}}} [--flags] "
                      "(--helpfull for flags)"))
  argv = flag_parsing.with_config(argv, meshtrain.config.__file__)
  app.run(_guarded(COMMANDS[argv[0]]), argv=[f"meshtrain {argv[0]}", *argv[1:]],
          flags_parser=_parse_flags)


if __name__ == "__main__":
  run()
