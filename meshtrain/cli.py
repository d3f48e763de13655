"""`meshtrain COMMAND [--flags]`: one absl program per command.

  meshtrain train --config configs/tiny.py --config.steps=300 --config.mesh.data=8
  meshtrain launch --num_processes 2 --devices_per_process 4 -- train --config configs/tiny.py
"""

import dataclasses
import json
import sys
from pathlib import Path

import jax
from absl import app, flags, logging
from ml_collections import config_flags

import meshtrain.config
from meshtrain import distributed, launch
from meshtrain.analysis import clusters, search
from meshtrain.analysis.plan import format_plan, plan
from meshtrain.errors import ConfigError, TrainingHalted
from meshtrain.parallel.pipeline import draw, schedule as schedules
from meshtrain.train.loop import train

_CONFIG = config_flags.DEFINE_config_file(
    "config", default=meshtrain.config.__file__,
    help_string="A config file with get_config(); `file.py:arg` passes arg. "
                "Override any key with --config.KEY=VALUE.",
    lock_config=True)
_JSON = flags.DEFINE_bool("json", False, "plan: print JSON instead of tables")
_COMPILE = flags.DEFINE_bool("compile", False, "plan: also compile the step and read its memory "
                             "and collectives (on --devices simulated CPU devices if set)")
_DEVICES = flags.DEFINE_integer("devices", None, "plan: devices to plan for (default: the "
                                "config's simulate_devices, else the devices present)")
_SEARCH = flags.DEFINE_bool("search", False, "plan: search meshes, ZeRO stage, recomputation and "
                            "microbatches for --devices of --cluster, fastest first")
_CLUSTER = flags.DEFINE_string("cluster", "h100", "plan --search: a preset (h100, h200, a100_80gb, "
                               "b200, tpu_v5p) or a JSON file with the same fields")
_TOP = flags.DEFINE_integer("top", 5, "plan --search: how many configurations to print")
_GLOBAL_BATCH = flags.DEFINE_integer("global_batch", None, "plan --search: sequences per step "
                                     "(default: the config's)")
_SEQ_LEN = flags.DEFINE_integer("seq_len", None, "plan --search: tokens per sequence "
                                "(default: the config's)")
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


def train_command(argv: list[str]) -> None:
  del argv
  logging.set_verbosity(logging.WARNING)  # keep the terminal to the progress bar
  cfg = _CONFIG.value
  _use_simulated_devices(cfg)
  distributed.initialize(cfg.distributed)
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
  cfg = _CONFIG.value
  if _SEARCH.value:
    _search(cfg)
    return
  if _COMPILE.value and _DEVICES.value:
    cfg.simulate_devices = _DEVICES.value
  _use_simulated_devices(cfg)
  devices = _DEVICES.value or cfg.simulate_devices or jax.device_count()
  report = plan(cfg, devices, _COMPILE.value)
  print(json.dumps(report, indent=2) if _JSON.value else format_plan(report))


def _search(cfg) -> None:
  if not _DEVICES.value or _DEVICES.value < 1:
    raise ConfigError("--devices", "plan --search needs the number of devices to plan for, "
                      "e.g. --devices 1024")
  with cfg.unlocked():
    cfg.global_batch = _GLOBAL_BATCH.value or cfg.global_batch
    cfg.seq_len = _SEQ_LEN.value or cfg.seq_len
  cluster = clusters.load(_CLUSTER.value)
  config_arg = f"--config={config_flags.get_config_filename(flags.FLAGS['config'])}"
  results, fitting, _ = search.search(cfg, _DEVICES.value, cluster, _TOP.value)
  if _JSON.value:
    print(json.dumps({"cluster": dataclasses.asdict(cluster), "devices": _DEVICES.value,
                      "fitting": fitting, "achievable": search.ACHIEVABLE,
                      "results": [e.as_dict(config_arg) for e in results]}, indent=2))
  elif not results:
    print(f"nothing fits: no mesh of {_DEVICES.value} x {cluster.name} holds this model at "
          f"global_batch={cfg.global_batch}, seq_len={cfg.seq_len}")
  else:
    print(search.format_search(results, fitting, cluster, _DEVICES.value, config_arg))


def schedule_command(argv: list[str]) -> None:
  del argv
  try:
    table = schedules.build(_SCHEDULE.value, _STAGES.value, _MICROBATCHES.value, _VIRTUAL.value)
  except ValueError as error:
    raise ConfigError("--schedule/--stages/--microbatches/--virtual", str(error)) from None
  summary = schedules.describe(table, 1.0, _BACKWARD_COST.value)
  if _OUT.value:
    draw.draw_gantt(table, _OUT.value, 1.0, _BACKWARD_COST.value)
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
  sys.exit(launch.launch(command, _NUM_PROCESSES.value, _DEVICES_PER_PROCESS.value))


COMMANDS = {"train": train_command, "plan": plan_command, "schedule": schedule_command,
            "launch": launch_command}


def _guarded(command):
  def main(argv):
    try:
      command(argv)
    except ConfigError as error:
      print(f"error: {error}", file=sys.stderr)
      sys.exit(2)
    except TrainingHalted as error:
      print(f"stopped: {error}", file=sys.stderr)
      sys.exit(3)
  return main


def run() -> None:
  """The `meshtrain` console script."""
  if len(sys.argv) < 2 or sys.argv[1] not in COMMANDS:
    print(f"usage: meshtrain {{{'|'.join(COMMANDS)}}} [--flags]   (--helpfull for flags)",
          file=sys.stderr)
    sys.exit(2)
  name = sys.argv[1]
  app.run(_guarded(COMMANDS[name]), argv=[f"meshtrain {name}", *sys.argv[2:]])


if __name__ == "__main__":
  run()
