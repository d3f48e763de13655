"""`meshtrain verify`: the config's sharded step against the same step
unsharded under plain jit; exits 1 when they differ by more than float32
reordering explains."""

import sys

from absl import flags, logging

from meshtrain.analysis import selfcheck
from meshtrain.cli import common, flag_parsing
from meshtrain.errors import ConfigError

FLAGS = flags.FlagValues()
CONFIG = flag_parsing.define_config(FLAGS)
_VERIFY_STEPS = flags.DEFINE_integer("verify_steps", 2, "train steps to compare",
                                     flag_values=FLAGS)

MAX_VERIFY_STEPS = 1000  # each is a step of both programs, on these devices


def main(argv: list[str]) -> None:
  del argv
  logging.set_verbosity(logging.WARNING)
  _check_flags()
  cfg = common.joined_config(CONFIG)
  report = selfcheck.verify_config(cfg, _VERIFY_STEPS.value)
  print(report.format())
  if not report.ok():
    sys.exit(1)


def _check_flags() -> None:
  if not 1 <= _VERIFY_STEPS.value <= MAX_VERIFY_STEPS:
    raise ConfigError("--verify_steps", f"is {_VERIFY_STEPS.value}; compare 1 to "
                      f"{MAX_VERIFY_STEPS} train steps (a few show a difference)")


def _before_launch(distributed_settings: dict):
  _check_flags()
  return common.as_launched(CONFIG.value, distributed_settings)


COMMAND = common.Command("verify", FLAGS, main, CONFIG, before_launch=_before_launch)
