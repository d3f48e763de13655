"""`meshtrain train`: a model trained from a config; a workdir resumes where it stopped."""

from pathlib import Path

import jax
from absl import flags, logging

from meshtrain import validate
from meshtrain.cli import common, flag_parsing
from meshtrain.train.loop import train

FLAGS = flags.FlagValues()
CONFIG = flag_parsing.define_config(FLAGS)


def main(argv: list[str]) -> None:
  del argv
  logging.set_verbosity(logging.WARNING)  # keep the terminal to the progress bar
  cfg = common.joined_config(CONFIG, writes_workdir=True)
  records = train(cfg)
  if jax.process_index():
    return
  if not records:
    print(f"nothing to do: {cfg.workdir} is already at config.steps={cfg.steps}")
  elif records[-1]["step"] == cfg.steps:
    print(f"done: step {records[-1]['step']}, loss {records[-1]['loss']:.4f}, "
          f"metrics in {Path(cfg.workdir) / 'metrics.jsonl'}")


def _paths():
  cfg = CONFIG.value
  return [("config.checkpoint.restore_from", cfg.checkpoint.restore_from, False),
          ("config.init_from", cfg.init_from.removeprefix("hf:"), False)]


def _before_launch(distributed_settings: dict):
  cfg = common.as_launched(CONFIG.value, distributed_settings)
  validate.check_workdir(cfg)
  return cfg


COMMAND = common.Command("train", FLAGS, main, CONFIG, paths=_paths,
                         job_workdir=lambda: Path(CONFIG.value.workdir),
                         before_launch=_before_launch)
