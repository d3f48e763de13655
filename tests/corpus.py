"""Real text for tests, on any machine: the docstrings of the installed
Python's standard library, read with `ast` (nothing imported), one paragraph
per blank-line-separated document, about 1.1 MB as the Shakespeare corpus the
README's examples use. `MESHTRAIN_TEST_TEXT` names another UTF-8 file instead."""

import ast
import os
import sysconfig
from pathlib import Path

SIZE = 1_100_000  # bytes, like tinyshakespeare.txt


def _docstrings(source: str) -> list[str]:
  try:
    tree = ast.parse(source)
  except (SyntaxError, ValueError):
    return []
  nodes = [tree, *(n for n in ast.walk(tree)
                   if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)))]
  return [doc for doc in map(ast.get_docstring, nodes) if doc]


def write_corpus(path: Path) -> Path:
  """Writes the standard library's docstrings into `path` until SIZE bytes."""
  stdlib = Path(sysconfig.get_paths()["stdlib"])
  paragraphs, size = [], 0
  sources = sorted(p for p in stdlib.rglob("*.py")
                   if not {"test", "tests", "idle_test", "site-packages"} & set(p.parts))
  for source in sources:
    for doc in _docstrings(source.read_text(encoding="utf-8", errors="replace")):
      for paragraph in doc.split("\n\n"):
        text = " ".join(paragraph.split())
        if len(text) > 40 and text.isascii():
          paragraphs.append(text)
          size += len(text) + 2
    if size >= SIZE:
      break
  path.write_text("\n\n".join(paragraphs) + "\n", encoding="utf-8")
  return path


def real_text(directory: Path) -> Path:
  """`MESHTRAIN_TEST_TEXT`, or the corpus written into `directory`."""
  given = os.environ.get("MESHTRAIN_TEST_TEXT")
  return Path(given) if given else write_corpus(directory / "stdlib_docs.txt")
