"""`meshtrain COMMAND [--flags]`: one absl program per command, each defined
by a module here with flags of its own (`common.Command`).

  meshtrain train --config configs/tiny.py --config.steps=300 --config.mesh.data=8
  meshtrain launch --num_processes 2 --devices_per_process 4 -- train --config configs/tiny.py
  meshtrain verify --config configs/fsdp.py:tiny --config.simulate_devices=8
"""

import sys

from meshtrain.cli import (common, evaluate, export_hf, generate, import_hf, launch, plan,
                           plot, prepare, schedule, show_config, train, usage, verify)
from meshtrain.errors import ConfigError

COMMANDS = {command.name: command for command in (
    train.COMMAND, plan.COMMAND, schedule.COMMAND, launch.COMMAND, prepare.COMMAND,
    evaluate.COMMAND, import_hf.COMMAND, export_hf.COMMAND, generate.COMMAND, verify.COMMAND,
    plot.COMMAND, show_config.COMMAND)}


def _help(argv: list[str]) -> None:
  """`meshtrain`, `meshtrain --help` and `meshtrain help` list the commands;
  `meshtrain COMMAND --help` (or `help COMMAND`) lists its flags; both exit 0."""
  own = argv[:argv.index("--")] if "--" in argv else argv  # after --: launch's command
  if own[:1] == ["help"] and own[1:2] and own[1] in COMMANDS:
    own = [own[1], "--help"]
  if not own or own[0] in ("help", *usage.HELP_FLAGS):
    print(usage.commands_text())
    sys.exit(0)
  if own[0] in COMMANDS and any(arg in usage.HELP_FLAGS for arg in own[1:]):
    command = COMMANDS[own[0]]
    print(usage.command_text(command.name, command.flag_values,
                             command.config.reads_file if command.config else None))
    sys.exit(0)


def run(argv: list[str] | None = None) -> None:
  """The `meshtrain` console script; `argv` (default sys.argv[1:]) starts with the command."""
  argv = sys.argv[1:] if argv is None else list(argv)
  _help(argv)
  if argv[0] not in COMMANDS:
    common.fail(ConfigError("command", f"{argv[0]!r} is not a command; use meshtrain "
                            f"{{{'|'.join(COMMANDS)}}} [--flags] (`meshtrain help` lists them)"))
  common.run(COMMANDS[argv[0]], argv)
