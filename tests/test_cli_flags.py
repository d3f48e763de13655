"""`cli.FLAGS_READ`, the flags each command reads, against what its code reads:
the flag holders (`cli.OWN_FLAGS`) that the command's function names, or the
functions of cli.py it calls, transitively."""

import ast
from pathlib import Path

import pytest

from meshtrain import cli

MODULE = ast.parse(Path(cli.__file__).read_text())
FUNCTIONS = {node.name: node for node in MODULE.body if isinstance(node, ast.FunctionDef)}
FLAG_NAMES = {holder: getattr(cli, holder).name for holder in cli.OWN_FLAGS}
# launch checks the launched command's flags, read as that command reads them: apart.
ON_BEHALF = "_check_launched"


def _is_config_flag(node: ast.AST) -> bool:
  """`flags.FLAGS["config"]`: the --config flag itself, for its overrides alone."""
  return (isinstance(node, ast.Subscript) and ast.unparse(node.value) == "flags.FLAGS"
          and isinstance(node.slice, ast.Constant) and node.slice.value == "config")


def flags_read(function: str, skip: str | None = ON_BEHALF) -> set[str]:
  """FLAGS_READ's names of what `function` of cli.py reads and what the
  functions of cli.py it calls read (but `skip`'s): a holder's flag name;
  "config" and "config." for `_CONFIG` (the file with its --config.KEY
  overrides); "config." for `flags.FLAGS["config"]` (the overrides, which a
  saved run's config takes)."""
  read, seen, todo = set(), set(), [function]
  while todo:
    name = todo.pop()
    if name in seen or name == skip:
      continue
    seen.add(name)
    for node in ast.walk(FUNCTIONS[name]):
      if isinstance(node, ast.Name) and node.id in FLAG_NAMES:
        read |= {"config", "config."} if node.id == "_CONFIG" else {FLAG_NAMES[node.id]}
      elif _is_config_flag(node):
        read.add("config.")
      elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
            and node.func.id in FUNCTIONS):
        todo.append(node.func.id)
  return read


@pytest.mark.parametrize("command", cli.FLAGS_READ, ids=lambda command: command.__name__)
def test_flags_read_lists_the_flags_each_command_reads(command):
  assert flags_read(command.__name__) == set(cli.FLAGS_READ[command])


def test_launch_reads_of_the_launched_command_only_its_flags():
  launched = set().union(*(cli.FLAGS_READ[cli.COMMANDS[name]] for name in cli.LAUNCHED))
  assert flags_read(ON_BEHALF, skip=None) <= launched
