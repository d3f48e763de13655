"""`meshtrain eval`: the held-out loss of a run's checkpoint, as JSON."""

import json

import jax
from absl import flags, logging

from meshtrain.cli import common
from meshtrain.train.evaluate import evaluate_checkpoint

FLAGS = flags.FlagValues()
RUN = common.SavedRun.define(FLAGS)


def main(argv: list[str]) -> None:
  del argv
  logging.set_verbosity(logging.WARNING)
  cfg, step = RUN.joined()
  result = evaluate_checkpoint(cfg, RUN.workdir.value, step)
  if jax.process_index() == 0:
    print(json.dumps(result))


COMMAND = common.Command("eval", FLAGS, main, RUN.config,
                         paths=lambda: [("--workdir", RUN.workdir.value, False)],
                         before_launch=lambda joined: common.as_launched(RUN.checked()[0], joined))
