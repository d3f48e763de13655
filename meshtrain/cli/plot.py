"""`meshtrain plot`: a run's loss, eval loss and learning rate drawn from its metrics.jsonl."""

from pathlib import Path

from absl import flags

from meshtrain.cli import common
from meshtrain.errors import ConfigError
from meshtrain.train import plot

FLAGS = flags.FlagValues()
_WORKDIR = flags.DEFINE_string("workdir", None, "the run's workdir", flag_values=FLAGS)
_OUT = flags.DEFINE_string("out", None, "the picture (default WORKDIR/metrics.png)",
                           flag_values=FLAGS)


def main(argv: list[str]) -> None:
  del argv
  if not _WORKDIR.value:
    raise ConfigError("--workdir", "give the workdir of a run: meshtrain plot --workdir runs/tiny")
  out = plot.draw(_WORKDIR.value, _OUT.value or Path(_WORKDIR.value) / "metrics.png")
  print(f"plotted {Path(_WORKDIR.value) / 'metrics.jsonl'}: {out}")


COMMAND = common.Command("plot", FLAGS, main)
