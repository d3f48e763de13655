"""`meshtrain generate`: text sampled from a run's checkpoint."""

import json
from pathlib import Path

import jax
from absl import flags, logging

from meshtrain import generate as generation
from meshtrain.cli import common
from meshtrain.data import tokenizer as tokenizers
from meshtrain.errors import ConfigError
from meshtrain.train.setup import build

FLAGS = flags.FlagValues()
RUN = common.SavedRun.define(FLAGS)
_PROMPT = flags.DEFINE_string("prompt", None, "the text to continue", flag_values=FLAGS)
_PROMPTS = flags.DEFINE_string("prompts", None, "a file of prompts, one per line",
                               flag_values=FLAGS)
_MAX_TOKENS = flags.DEFINE_integer("max_tokens", 100, "new tokens per prompt at most",
                                   flag_values=FLAGS)
_TEMPERATURE = flags.DEFINE_float("temperature", 1.0, "softmax temperature; 0 is greedy",
                                  flag_values=FLAGS)
_TOP_K = flags.DEFINE_integer("top_k", 0, "sample from the k likeliest tokens (0: all)",
                              flag_values=FLAGS)
_TOP_P = flags.DEFINE_float("top_p", 1.0, "sample from the likeliest tokens holding "
                            "this share of the probability", flag_values=FLAGS)
_SEED = flags.DEFINE_integer("seed", 0, "random seed of the sampling", flag_values=FLAGS)
_JSON = flags.DEFINE_bool("json", False, "one JSON object per prompt", flag_values=FLAGS)


def main(argv: list[str]) -> None:
  del argv
  logging.set_verbosity(logging.WARNING)
  texts = _check_flags()
  cfg, step = RUN.joined()
  sampling = _sampling(cfg)
  setup = build(cfg)
  tokenizer = tokenizers.for_config(cfg)
  prompts = generation.prompt_ids(tokenizer, texts, cfg.model.vocab_size)
  generator = generation.from_workdir(RUN.workdir.value, step, setup, eos_id=tokenizer.eos_id)
  outputs = generator(prompts, _MAX_TOKENS.value, sampling, _SEED.value)
  if jax.process_index():
    return
  for text, prompt, tokens in zip(texts, prompts, outputs):
    completion = tokenizer.decode(tokens)
    if _JSON.value:
      print(json.dumps({"prompt_tokens": prompt, "tokens": tokens, "text": completion}))
    else:
      print(f"{text}{completion}\n")


def _prompt_texts() -> list[str]:
  if bool(_PROMPT.value is not None) == bool(_PROMPTS.value):
    raise ConfigError("--prompt", "give either --prompt TEXT or --prompts FILE (one prompt a line)")
  if _PROMPT.value is not None:
    try:
      _PROMPT.value.encode("utf-8")
    except UnicodeEncodeError:  # bytes that are not UTF-8 in the command line
      raise ConfigError("--prompt", "is not UTF-8 text; give it in UTF-8, or in a UTF-8 file "
                        "with --prompts") from None
    return [_PROMPT.value]
  try:
    texts = [line for line in Path(_PROMPTS.value).read_text().splitlines() if line.strip()]
  except (OSError, UnicodeDecodeError) as error:
    raise ConfigError("--prompts", f"cannot read {_PROMPTS.value} ({error})") from None
  if not texts:
    raise ConfigError("--prompts", f"{_PROMPTS.value} holds no prompt")
  return texts


def _check_flags() -> list[str]:
  """The flags but the sampling's (`_sampling`); returns the prompts."""
  texts = _prompt_texts()
  if _MAX_TOKENS.value < 1:
    raise ConfigError("--max_tokens", f"{_MAX_TOKENS.value} must be >= 1")
  if not 0 <= _SEED.value < 2**32:
    raise ConfigError("--seed", f"is {_SEED.value}; give a seed in [0, 2**32), as config.seed")
  return texts


def _sampling(cfg) -> generation.Sampling:
  sampling = generation.Sampling(_TEMPERATURE.value, _TOP_K.value, _TOP_P.value)
  sampling.check(cfg.model.vocab_size)
  return sampling


def _before_launch(distributed_settings: dict):
  _check_flags()
  cfg = common.as_launched(RUN.checked()[0], distributed_settings)
  _sampling(cfg)
  return cfg


COMMAND = common.Command("generate", FLAGS, main, RUN.config,
                         paths=lambda: [("--workdir", RUN.workdir.value, False)],
                         before_launch=_before_launch)
