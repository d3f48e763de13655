"""The package's floors: each module imports only from the floors below its own
(docs/layout.md lists them, top to bottom), so the training path never
reaches up into the planner or the commands."""

import ast
import re

from conftest import REPO

PACKAGE = REPO / "meshtrain"


def floors() -> list[str]:
  """docs/layout.md's floors of meshtrain/, top to bottom ("train/", "cli/")."""
  block = (REPO / "docs/layout.md").read_text().split("meshtrain/ ", 1)[1].split("\nconfigs/", 1)[0]
  return re.findall(r"^  (\S+)", block, flags=re.M)


def floor_of(name: str) -> str:
  """The floor of `meshtrain.NAME...` or of a path under meshtrain/."""
  return name + "/" if (PACKAGE / name).is_dir() else name + ".py"


def imports(path) -> set[str]:
  """The floors of meshtrain that the module at `path` imports, anywhere in it."""
  found = set()
  for node in ast.walk(ast.parse(path.read_text())):
    names = []
    if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
      parts = node.module.split(".")
      if parts[0] == "meshtrain":
        names = parts[1:2] or [alias.name for alias in node.names]
    elif isinstance(node, ast.Import):
      names = [a.name.split(".")[1] for a in node.names if a.name.startswith("meshtrain.")]
    found.update(floor_of(name) for name in names)
  return found


def test_every_module_imports_only_the_floors_below_its_own():
  order = floors()
  modules = [p for p in PACKAGE.rglob("*.py") if p != PACKAGE / "__init__.py"]
  unlisted = {floor_of(p.relative_to(PACKAGE).parts[0].removesuffix(".py")) for p in modules}
  assert unlisted <= set(order), f"docs/layout.md lists no floor for {unlisted - set(order)}"
  upward = set()
  for path in modules:
    own = floor_of(path.relative_to(PACKAGE).parts[0].removesuffix(".py"))
    upward |= {(own, floor) for floor in imports(path)
               if floor != own and order.index(floor) < order.index(own)}
  assert not upward, f"imports from a floor above (own, imported): {sorted(upward)}"


def test_the_check_finds_an_import_from_above(tmp_path):
  module = tmp_path / "low.py"
  module.write_text("def f():\n  from meshtrain.planner import plan\n  import meshtrain.cli\n")
  assert imports(module) == {"planner/", "cli/"}


MAX_FUNCTION_LINES = 80  # docstring included: a function that needs more is two


def long_functions(path) -> list[str]:
  """`name (N lines)` for each function at `path` longer than MAX_FUNCTION_LINES."""
  return [f"{node.name} ({node.end_lineno - node.lineno + 1} lines)"
          for node in ast.walk(ast.parse(path.read_text()))
          if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
          and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES]


def test_no_function_is_longer_than_80_lines(tmp_path):
  long = {str(p.relative_to(REPO)): found for p in sorted(PACKAGE.rglob("*.py"))
          if (found := long_functions(p))}
  assert not long, f"split these: {long}"
  module = tmp_path / "long.py"
  module.write_text("def f():\n" + "  x = 1\n" * MAX_FUNCTION_LINES)
  assert long_functions(module) == [f"f ({MAX_FUNCTION_LINES + 1} lines)"]
