"""`meshtrain import-hf`: a Hugging Face model directory as a run's step-0 checkpoint."""

from pathlib import Path

import jax
from absl import flags, logging

from meshtrain import hf_import
from meshtrain.cli import common, flag_parsing
from meshtrain.errors import ConfigError
from meshtrain.hf import importer

FLAGS = flags.FlagValues()
CONFIG = flag_parsing.define_config(FLAGS)
_FROM = flags.DEFINE_string("from", None, "a Hugging Face Llama directory", flag_values=FLAGS)
_TO = flags.DEFINE_string("to", None, "the workdir to write", flag_values=FLAGS)


def main(argv: list[str]) -> None:
  del argv
  logging.set_verbosity(logging.WARNING)
  _check_flags()
  cfg = common.joined_config(CONFIG)
  workdir = hf_import.import_hf(cfg, _FROM.value, _TO.value)
  if jax.process_index() == 0:
    print(f"imported {_FROM.value} into {workdir}; fine-tune with "
          f"`meshtrain train --config configs/finetune_hf.py:{workdir}`")
    for note in (importer.balancing_note(Path(_FROM.value), cfg.model.moe),
                 importer.left_out_note(Path(_FROM.value), cfg.model.mtp_layers)):
      if note:
        print(note)


def _check_flags() -> None:
  if not _FROM.value or not _TO.value:
    raise ConfigError("--from/--to", "give both: meshtrain import-hf --from HF_DIR --to WORKDIR")


def _before_launch(distributed_settings: dict):
  _check_flags()
  cfg = common.as_launched(CONFIG.value, distributed_settings)
  hf_import.prepare(cfg, Path(_FROM.value), Path(_TO.value).absolute())  # as each process will
  return cfg


COMMAND = common.Command("import-hf", FLAGS, main, CONFIG,
                         paths=lambda: [("--to", _TO.value, True), ("--from", _FROM.value, False)],
                         before_launch=_before_launch)
