"""Each command's module defines its flags in a `FlagValues` of its own and
reads every one of them: no flag a command accepts does nothing, and a flag
of another command is unknown to it."""

import ast
import collections
import sys
from pathlib import Path

import pytest

from meshtrain import cli

# What a module-level holder of a command's flags is assigned from.
DEFINERS = ("flags.DEFINE_", "flag_parsing.define_config", "common.SavedRun.define")


def holders(tree: ast.Module) -> set[str]:
  """The module-level names assigned a flag holder (or a group of them)."""
  return {target.id for node in tree.body if isinstance(node, ast.Assign)
          and isinstance(node.value, ast.Call)
          and ast.unparse(node.value.func).startswith(DEFINERS)
          for target in node.targets if isinstance(target, ast.Name)}


def unread(path: Path) -> set[str]:
  """The holders of the module at `path` that nothing in it reads."""
  tree = ast.parse(path.read_text())
  reads = collections.Counter(node.id for node in ast.walk(tree)
                              if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load))
  return {name for name in holders(tree) if not reads[name]}


@pytest.mark.parametrize("name", cli.COMMANDS)
def test_each_command_reads_every_flag_it_defines(name):
  command = cli.COMMANDS[name]
  module = sys.modules[command.main.__module__]
  assert holders(ast.parse(Path(module.__file__).read_text())), name
  assert not unread(Path(module.__file__)), name
  # every flag it accepts is one its module defines
  own = {holder.name for holder in vars(module).values() if hasattr(holder, "present")}
  own |= {"config"} if command.config else set()
  own |= {"workdir", "step"} if hasattr(module, "RUN") else set()
  accepted = {flag for flag in command.flag_values if not flag.startswith("config.")}
  assert accepted == own, name


def test_the_commands_share_no_flags_object():
  assert len({id(c.flag_values) for c in cli.COMMANDS.values()}) == len(cli.COMMANDS)


def test_the_check_finds_a_flag_nothing_reads(tmp_path):
  module = tmp_path / "command.py"
  module.write_text("FLAGS = flags.FlagValues()\n"
                    "_READ = flags.DEFINE_bool('read', False, '', flag_values=FLAGS)\n"
                    "_IDLE = flags.DEFINE_bool('idle', False, '', flag_values=FLAGS)\n"
                    "def main(argv):\n  return _READ.value\n")
  assert unread(module) == {"_IDLE"}
