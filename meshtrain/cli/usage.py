"""What `meshtrain`, `meshtrain COMMAND --help` and `meshtrain config` print.

The text comes from what the program already holds: each command's summary
from `SUMMARIES`, its flags (absl's help strings and defaults) from the flags
its module defines, and the config keys with the one comment per field that
`meshtrain/config.py` carries beside each assignment.
"""

import io
import re
import textwrap
import tokenize
from pathlib import Path

from absl import flags

import meshtrain.config

# One line per command, in the order a new user meets them.
SUMMARIES = {
    "train": "train a model from a config (--config FILE, --config.KEY=VALUE); resumes its workdir",
    "plan": "memory per device and collectives of a config, with a verdict; --search ranks layouts",
    "schedule": "print and draw a pipeline schedule (F, B, W ops) and its bubble",
    "prepare": "tokenize text, JSONL, Parquet or chat files into a corpus for training",
    "eval": "held-out loss of a run's checkpoint, as JSON",
    "generate": "sample text from a run's checkpoint",
    "plot": "draw a run's loss, eval loss and learning rate from its metrics.jsonl",
    "import-hf": "a Hugging Face model directory as a run's step-0 checkpoint",
    "export-hf": "a run's checkpoint as a Hugging Face model directory",
    "verify": "the config's sharded step against the same step unsharded (exit 1 on a mismatch)",
    "launch": "start N local processes as N hosts: launch --num_processes 2 -- train ...",
    "config": "list every config key with its value and comment (--config FILE for a preset's)",
    "help": "this list; `meshtrain help COMMAND` is `meshtrain COMMAND --help`",
}
HELP_FLAGS = ("--help", "-help", "-h", "--helpfull", "--helpshort", "-?")


def commands_text() -> str:
  """The list of commands, one line each."""
  width = max(map(len, SUMMARIES))
  lines = ["usage: meshtrain COMMAND [--flags]   (meshtrain COMMAND --help: its flags)", ""]
  lines += [f"  {name:<{width}}  {summary}" for name, summary in SUMMARIES.items()]
  lines += ["", "Start with: meshtrain train --config configs/tiny.py   (README.md, docs/README.md)"]
  return "\n".join(lines)


def command_text(command: str, flag_values: flags.FlagValues, reads_file: bool | None) -> str:
  """`command`'s flags, those `flag_values` defines, each with absl's help
  string and default. `reads_file`: whether it reads a `--config` file (None:
  it has no --config; False: only the overrides, of a saved run's config)."""
  lines = [f"usage: meshtrain {command} [--flags]", f"  {SUMMARIES[command]}", ""]
  if reads_file:
    lines += _flag_lines("--config FILE[:ARG]", "a config file with get_config(); "
                         "configs/NAME.py:MODEL passes MODEL to a strategy preset",
                         "meshtrain/config.py")
  if reads_file is not None:
    lines += _flag_lines("--config.KEY=VALUE", "set any config key, e.g. "
                         "--config.steps=300 --config.mesh.fsdp=8; `meshtrain config` lists "
                         "them with their defaults", None)
  for name in flag_values:
    if name != "config" and not name.startswith("config."):
      flag = flag_values[name]
      lines += _flag_lines(f"--{name}", flag.help, flag.default_as_str or None)
  return "\n".join(lines)


def _flag_lines(flag: str, help_text: str, default: str | None) -> list[str]:
  text = help_text + (f" (default: {default})" if default else "")
  return [f"  {flag}", *textwrap.wrap(text, 92, initial_indent="      ",
                                      subsequent_indent="      ")]


def config_comments(path=meshtrain.config.__file__) -> dict[str, str]:
  """`KEY: comment` for each `c.KEY = ...  # comment` line of a config file
  (dotted keys: `mesh.data`); a group's comment is kept under its own key."""
  source = Path(path).read_text()
  comments = {}
  tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
  lines = source.splitlines()
  for token in tokens:
    if token.type != tokenize.COMMENT:
      continue
    code = lines[token.start[0] - 1][:token.start[1]]
    assigned = re.match(r"\s*c\.([\w.]+)\s*=", code)
    if assigned:
      comments[assigned.group(1)] = token.string.lstrip("#").strip()
  return comments


def config_text(cfg, path=meshtrain.config.__file__) -> str:
  """Every key of `cfg` with its value and the comment config.py gives it."""
  comments = config_comments(path)
  rows = []

  def walk(tree, prefix):
    for key, value in tree.items():
      name = f"{prefix}{key}"
      if hasattr(value, "items"):
        walk(value, f"{name}.")
      else:
        rows.append((name, repr(value), comments.get(name, "")))

  walk(cfg, "")
  width = max(len(name) + len(value) for name, value, _ in rows) + 3
  lines = ["config keys (set one with --config.KEY=VALUE; meshtrain/config.py holds them):"]
  for name, value, comment in rows:
    lines.append((f"  {name} = {value}".ljust(width + 2) + f"  # {comment}") if comment
                 else f"  {name} = {value}")
  return "\n".join(lines)
