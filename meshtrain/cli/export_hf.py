"""`meshtrain export-hf`: a run's checkpoint as a Hugging Face model directory."""

import jax
from absl import flags, logging

from meshtrain.cli import common
from meshtrain.errors import ConfigError
from meshtrain.hf import exporter
from meshtrain.train.parallelize import from_stage_slots
from meshtrain.train.relayout import read_weights
from meshtrain.train.setup import build

FLAGS = flags.FlagValues()
RUN = common.SavedRun.define(FLAGS)
_TO = flags.DEFINE_string("to", None, "the Hugging Face directory to write", flag_values=FLAGS)
_DTYPE = flags.DEFINE_string("dtype", "", "float32 | bfloat16 | float16 | float8 "
                             "(projections in e4m3 with a scale per 128 x 128 block, the rest "
                             "bfloat16; default: the imported model's, else float32)",
                             flag_values=FLAGS)
_MAX_SHARD_MB = flags.DEFINE_integer("max_shard_mb", 5120, "safetensors files above "
                                     "this size are split into shards with an index",
                                     flag_values=FLAGS)


def main(argv: list[str]) -> None:
  del argv
  logging.set_verbosity(logging.WARNING)
  _check_flags()
  cfg, step = RUN.joined()
  workdir = RUN.workdir.value
  setup = build(cfg)
  params, model_state = (None if tree is None else from_stage_slots(setup.run.layout, tree)
                         for tree in read_weights(workdir, step, setup))
  files = exporter.export_hf(cfg, params, workdir, _TO.value, model_state=model_state,
                             dtype=_DTYPE.value, max_shard_bytes=_MAX_SHARD_MB.value * 2**20)
  if jax.process_index() == 0:
    print(f"exported step {step} of {workdir} to {_TO.value}: {', '.join(files)}")


def _check_flags() -> None:
  if not _TO.value:
    raise ConfigError("--to", "give the directory to write: "
                      "meshtrain export-hf --workdir W --to DIR")
  exporter.check_target(_TO.value)
  if _MAX_SHARD_MB.value < 1:
    raise ConfigError("--max_shard_mb", f"is {_MAX_SHARD_MB.value}; give the largest file in "
                      "MB, 1 or more (default 5120)")


def _before_launch(distributed_settings: dict):
  _check_flags()
  return common.as_launched(RUN.checked()[0], distributed_settings)


COMMAND = common.Command("export-hf", FLAGS, main, RUN.config,
                         paths=lambda: [("--to", _TO.value, True),
                                        ("--workdir", RUN.workdir.value, False)],
                         before_launch=_before_launch)
