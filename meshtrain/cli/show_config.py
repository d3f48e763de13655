"""`meshtrain config`: every config key with its value and comment."""

from absl import flags

from meshtrain.cli import common, flag_parsing, usage

FLAGS = flags.FlagValues()
CONFIG = flag_parsing.define_config(FLAGS)


def main(argv: list[str]) -> None:
  del argv
  print(usage.config_text(CONFIG.value))


COMMAND = common.Command("config", FLAGS, main, CONFIG)
