"""Flag parsing (absl + ml_collections) in which every bad flag is one ConfigError.

Each command holds its flags in a `FlagValues` of its own, so that a flag of
another command is absl's unknown flag. ml_collections reads the
`--config.KEY=VALUE` overrides from an argv list of its own, loads the config
file while the flags are parsed, and on a mistake raises one of many exception
kinds (a KeyError with "did you mean" for a typo, an OSError for a missing
file, a SyntaxError from the file itself); `parse` turns each into the key and
the fix.
"""

import dataclasses
import logging
import re
import traceback
from pathlib import Path

from absl import flags
from ml_collections import config_flags

from meshtrain import config as meshtrain_config, validate
from meshtrain.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class ConfigFlag:
  """A command's `--config` flag. `reads_file`: the command reads the file
  (train, plan); else only the `--config.KEY=VALUE` overrides, which a saved
  run's config takes (eval, generate, export-hf)."""
  holder: flags.FlagHolder
  flag_values: flags.FlagValues  # the command's, which the overrides join as they are parsed
  override_argv: list[str]  # the args ml_collections reads the overrides from: this command's
  reads_file: bool

  @property
  def value(self):
    return self.holder.value

  def overrides(self) -> dict:
    """The `--config.KEY=VALUE` flags given, as {KEY: VALUE}."""
    return config_flags.get_override_values(self.flag_values[self.holder.name])

  def filename(self) -> str:
    return config_flags.get_config_filename(self.flag_values[self.holder.name])


def define_config(flag_values: flags.FlagValues, reads_file: bool = True) -> ConfigFlag:
  """`--config FILE[:ARG]` with its `--config.KEY=VALUE` overrides, in `flag_values`."""
  override_argv: list[str] = []  # set by `parse` (not sys.argv: launch's command follows --)
  holder = config_flags.DEFINE_config_file(
      "config", default=meshtrain_config.__file__,
      help_string="A config file with get_config(); `file.py:arg` passes arg. "
                  "Override any key with --config.KEY=VALUE.",
      flag_values=flag_values, lock_config=True, sys_argv=override_argv)
  return ConfigFlag(holder, flag_values, override_argv, reads_file)


def parse(argv: list[str], flag_values: flags.FlagValues, config: ConfigFlag | None,
          command: str) -> list[str]:
  """`flag_values(argv)`, the flags of `command`; raises ConfigError for a bad
  flag. absl's own flags (`flags.FLAGS`) stay at their defaults."""
  own = argv[:argv.index("--")] if "--" in argv else argv  # after --: launch's command
  if config:
    config.override_argv[:] = own
    _check_override_keys(own)
  try:
    # In-process reruns start from the defaults, without the last run's override flags.
    for name in [name for name in flag_values if name.startswith("config.")]:
      delattr(flag_values, name)
    _unparse(flag_values)
    args = flag_values(argv)
    if config:
      config.value.keys()  # ml_collections reports a config file that failed to load here
  except Exception as error:  # noqa: BLE001 - any parse failure is the user's input
    raise _flag_error(own, error, command) from None
  if config:
    _own_workdir(config)
  if not flags.FLAGS.is_parsed():
    flags.FLAGS.mark_as_parsed()  # absl's app reads its own flags, at their defaults
  return args


def _unparse(flag_values: flags.FlagValues) -> None:
  """`flag_values` back at their defaults, without absl's INFO line saying so."""
  if not flag_values.is_parsed():
    return
  absl_logger = logging.getLogger("absl")
  level = absl_logger.level
  absl_logger.setLevel(logging.WARNING)
  try:
    flag_values.unparse_flags()
  finally:
    absl_logger.setLevel(level)


def _own_workdir(config: ConfigFlag) -> None:
  """A config file that sets no workdir, given none by a flag, gets its own
  (`config.preset_workdir`): runs of two presets never meet in runs/default."""
  cfg, filename, given_flags = config.value, config.filename(), config.flag_values
  given = "config.workdir" in given_flags and given_flags["config.workdir"].present
  default_file = (Path(filename.partition(":")[0]).resolve() ==
                  Path(meshtrain_config.__file__).resolve())
  if cfg.workdir == meshtrain_config.DEFAULT_WORKDIR and not given and not default_file:
    cfg.workdir = meshtrain_config.preset_workdir(filename)


def with_config(argv: list[str], default_file: str) -> list[str]:
  """`COMMAND --flags` with `--config` named (`default_file` when not given), so
  ml_collections loads it while parsing the flags, overrides included."""
  if any(re.match(r"--?config(=|$)", arg) for arg in argv):
    return list(argv)
  return [argv[0], f"--config={default_file}", *argv[1:]]


def _flag_error(argv: list[str], error: Exception, command: str) -> ConfigError:
  """A bad flag as the one-line error: absl and ml_collections raise many kinds."""
  message = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
  if isinstance(error, flags.UnrecognizedFlagError):
    return ConfigError(f"--{error.flagname}", f"is not a flag of `meshtrain {command}` "
                       f"({message}); remove it (`meshtrain {command} --help` lists its flags)")
  bad_value = re.match(r"flag --([\w.]+)=(.*?): (.*)", message)
  if bad_value and bad_value.group(1) != "config":
    name, value, reason = bad_value.groups()
    key = name if name.startswith("config.") else f"--{name}"
    return ConfigError(key, f"{value!r} is not valid ({reason})")
  if (bad_value or isinstance(error, OSError) or _raised_in_config_file(error, argv) or
      not _overrides(argv)):
    reasons = []  # ml_collections wraps the reason in two or three layers
    while error is not None:
      lines = str(error).strip().splitlines()
      reasons.append(lines[-1].strip() if lines else type(error).__name__)
      error = error.__cause__ or error.__context__
    reason = next((r for r in reasons if r.startswith("Could not override")), reasons[-1])
    return ConfigError("--config", f"cannot load the config ({reason}); give a config file "
                       "such as configs/tiny.py, or configs/NAME.py:MODEL for a strategy preset")
  return ConfigError(f"config.{_overrides(argv)[-1]}", message)


def _raised_in_config_file(error: Exception, argv: list[str]) -> bool:
  """Whether `error` came from running the `--config` file (a syntax error, a bad assignment)."""
  given = [argv[i + 1] if arg in ("--config", "-config") and i + 1 < len(argv)
           else arg.partition("=")[2] for i, arg in enumerate(argv)
           if re.match(r"--?config(=|$)", arg)]
  if not given:
    return False
  path = Path(given[-1].split(":")[0]).resolve()
  files = [getattr(error, "filename", None) if isinstance(error, SyntaxError) else None]
  files += [frame.f_code.co_filename for frame, _ in traceback.walk_tb(error.__traceback__)]
  return any(file and Path(file).resolve() == path for file in files)


def _overrides(argv: list[str]) -> list[str]:
  """The keys of the `--config.KEY=VALUE` flags in `argv`."""
  return [arg.split("=", 1)[0].split(".", 1)[1] for arg in argv
          if re.match(r"--?(no)?config\.", arg)]


def _check_override_keys(argv: list[str]) -> None:
  """Every `--config.KEY` names a key: "did you mean" over the whole tree, before
  ml_collections raises a traceback on a typo."""
  keys = validate.config_keys()
  for key in _overrides(argv):
    if key not in keys and key.startswith("no") and isinstance(keys.get(key[2:]), bool):
      key = key[2:]  # --config.noKEY sets a boolean false
    if key in keys:
      continue
    group = [k.rpartition(".")[2] for k in keys if k.startswith(key + ".")]
    if group:
      raise ConfigError(f"config.{key}", f"is a group of keys ({', '.join(group)}); set one of "
                        f"them, e.g. --config.{key}.{group[0]}=...")
    raise validate.unknown_key(key, keys)
