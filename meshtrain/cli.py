"""`meshtrain COMMAND [--flags]`: one absl program per command.

  meshtrain train --config configs/tiny.py --config.steps=300 --config.mesh.data=8
  meshtrain launch --num_processes 2 --devices_per_process 4 -- train --config configs/tiny.py
"""

import json
import sys
from pathlib import Path

import jax
from absl import app, flags, logging
from ml_collections import config_flags

import meshtrain.config
from meshtrain import distributed, generate, launch, workdir as saved_run
from meshtrain.analysis.plan import format_plan, plan
from meshtrain.data import tokenizer as tokenizers
from meshtrain.data.prepare import prepare
from meshtrain.errors import ConfigError, TrainingHalted
from meshtrain.evaluate import evaluate_checkpoint
from meshtrain.hf import exporter, importer
from meshtrain.parallel.pipeline import draw, schedule as schedules
from meshtrain.train.loop import train
from meshtrain.train.setup import build

_CONFIG = config_flags.DEFINE_config_file(
    "config", default=meshtrain.config.__file__,
    help_string="A config file with get_config(); `file.py:arg` passes arg. "
                "Override any key with --config.KEY=VALUE.",
    lock_config=True)
_JSON = flags.DEFINE_bool("json", False, "plan: print JSON instead of tables; generate: one "
                            "JSON object per prompt")
_COMPILE = flags.DEFINE_bool("compile", False, "plan: also compile the step and read its memory "
                             "and collectives (on --devices simulated CPU devices if set)")
_DEVICES = flags.DEFINE_integer("devices", None, "plan: devices to plan for (default: the "
                                "config's simulate_devices, else the devices present)")
_STAGES = flags.DEFINE_integer("stages", 4, "schedule: pipeline stages")
_MICROBATCHES = flags.DEFINE_integer("microbatches", 8, "schedule: microbatches per step")
_SCHEDULE = flags.DEFINE_enum("schedule", "1f1b", schedules.SCHEDULE_NAMES, "schedule: which one")
_VIRTUAL = flags.DEFINE_integer("virtual", 1, "schedule: model chunks per stage (interleaved)")
_COSTS = flags.DEFINE_string("costs", "1,1,1", "schedule: cost of F, B (input gradient) and "
                             "W (weight gradient) of one stage, e.g. 1,1,1 or 1,2,0 (Megatron)")
_OUT = flags.DEFINE_string("out", None, "schedule: write a Gantt chart PNG here; prepare: the "
                           "directory to create")
_INPUT = flags.DEFINE_multi_string("input", [], "prepare: text, JSONL or Parquet files, globs or "
                                   "directories (more paths may follow)")
_TOKENIZER = flags.DEFINE_string("tokenizer", "bytes", "prepare: bytes | PATH to a tokenizer.json "
                                 "(or its directory, or a prepared corpus) | train:N (a BPE of N ids)")
_TEXT_FIELD = flags.DEFINE_string("text_field", "text", "prepare: the JSONL field / Parquet column "
                                  "holding the text")
_SPLIT_BLANK_LINES = flags.DEFINE_bool("split_blank_lines", False, "prepare: blank lines separate "
                                       "documents in text files (default: one document per file)")
_VAL_FRACTION = flags.DEFINE_float("val_fraction", 0.05, "prepare: share of the tokens held out "
                                   "for evaluation")
_WORKDIR = flags.DEFINE_string("workdir", None, "eval, export-hf, generate: the run's workdir (its "
                               "saved config; --config.KEY=VALUE flags change it, e.g. the mesh)")
_STEP = flags.DEFINE_integer("step", None, "eval, export-hf, generate: the checkpoint "
                             "step (default: the newest)")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", 2, "launch: processes to start")
_DEVICES_PER_PROCESS = flags.DEFINE_integer(
    "devices_per_process", 0, "launch: simulated CPU devices per process (0: the config's)")

# import-hf / export-hf / generate
_FROM = flags.DEFINE_string("from", None, "import-hf: a Hugging Face Llama directory")
_TO = flags.DEFINE_string("to", None, "import-hf: the workdir to write; export-hf: the "
                          "Hugging Face directory to write")
_DTYPE = flags.DEFINE_string("dtype", "", "export-hf: float32 | bfloat16 | float16 "
                             "(default: the imported model's, else float32)")
_MAX_SHARD_MB = flags.DEFINE_integer("max_shard_mb", 5120, "export-hf: safetensors files above "
                                     "this size are split into shards with an index")
_PROMPT = flags.DEFINE_string("prompt", None, "generate: the text to continue")
_PROMPTS = flags.DEFINE_string("prompts", None, "generate: a file of prompts, one per line")
_MAX_TOKENS = flags.DEFINE_integer("max_tokens", 100, "generate: new tokens per prompt at most")
_TEMPERATURE = flags.DEFINE_float("temperature", 1.0, "generate: softmax temperature; 0 is greedy")
_TOP_K = flags.DEFINE_integer("top_k", 0, "generate: sample from the k likeliest tokens (0: all)")
_TOP_P = flags.DEFINE_float("top_p", 1.0, "generate: sample from the likeliest tokens holding "
                            "this share of the probability")
_SEED = flags.DEFINE_integer("seed", 0, "generate: random seed of the sampling")


def _use_simulated_devices(cfg) -> None:
  """Must run before anything touches a device (imports do not)."""
  if cfg.simulate_devices:
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", cfg.simulate_devices)


def train_command(argv: list[str]) -> None:
  del argv
  logging.set_verbosity(logging.WARNING)  # keep the terminal to the progress bar
  cfg = _CONFIG.value
  _use_simulated_devices(cfg)
  distributed.initialize(cfg.distributed)
  records = train(cfg)
  if jax.process_index():
    return
  if not records:
    print(f"nothing to do: {cfg.workdir} is already at config.steps={cfg.steps}")
  elif records[-1]["step"] == cfg.steps:
    print(f"done: step {records[-1]['step']}, loss {records[-1]['loss']:.4f}, "
          f"metrics in {Path(cfg.workdir) / 'metrics.jsonl'}")


def plan_command(argv: list[str]) -> None:
  del argv
  logging.set_verbosity(logging.WARNING)
  cfg = _CONFIG.value
  if _COMPILE.value and _DEVICES.value:
    cfg.simulate_devices = _DEVICES.value
  _use_simulated_devices(cfg)
  devices = _DEVICES.value or cfg.simulate_devices or jax.device_count()
  report = plan(cfg, devices, _COMPILE.value)
  print(json.dumps(report, indent=2) if _JSON.value else format_plan(report))


def _costs(text: str) -> tuple[float, float, float]:
  try:
    costs = tuple(float(c) for c in text.split(","))
  except ValueError:
    costs = ()
  if len(costs) != 3 or min(costs) < 0 or costs[0] <= 0:
    raise ConfigError("--costs", f"{text!r} is not three costs F,B,W (F > 0, B and W >= 0), "
                      "e.g. --costs=1,1,1")
  return costs


def schedule_command(argv: list[str]) -> None:
  del argv
  costs = _costs(_COSTS.value)
  try:
    table = schedules.build(_SCHEDULE.value, _STAGES.value, _MICROBATCHES.value, _VIRTUAL.value)
  except ValueError as error:
    raise ConfigError("--schedule/--stages/--microbatches/--virtual", str(error)) from None
  summary = schedules.describe(table, costs)
  if _OUT.value:
    draw.draw_gantt(table, _OUT.value, costs)
    summary["chart"] = _OUT.value
  if _JSON.value:
    print(json.dumps(summary, indent=2))
    return
  print(schedules.to_text(table))
  print(f"\nbubble fraction {summary['bubble_fraction']:.4f} with F,B,W costs {_COSTS.value} "
        f"(paper's formula {summary['paper_bubble_fraction']:.4f}, textbook (P-1)/(VM+P-1) "
        f"{summary['ideal_bubble_fraction']:.4f}); in flight per stage (awaiting B) "
        f"{summary['peak_in_flight']}, awaiting W {summary['peak_awaiting_w']}")
  if _OUT.value:
    print(f"chart: {_OUT.value}")


def prepare_command(argv: list[str]) -> None:
  inputs = _INPUT.value + argv[1:]  # `--input a b c`, as a shell glob expands
  if not inputs:
    raise ConfigError("--input", "give the text, JSONL or Parquet files to prepare")
  if not _OUT.value:
    raise ConfigError("--out", "give the directory to write the prepared corpus into")
  meta = prepare(inputs, _TOKENIZER.value, _OUT.value, text_field=_TEXT_FIELD.value,
                 split_blank_lines=_SPLIT_BLANK_LINES.value, val_fraction=_VAL_FRACTION.value)
  print(f"prepared {_OUT.value}: {meta['documents']:,} documents, {meta['tokens']:,} tokens "
        f"({meta['dtype']}, vocabulary {meta['vocab_size']}); validation tokens "
        f"{meta['split']['val'][1] - meta['split']['val'][0]:,}")


def eval_command(argv: list[str]) -> None:
  del argv
  logging.set_verbosity(logging.WARNING)
  cfg, step = _saved_run()
  result = evaluate_checkpoint(cfg, _WORKDIR.value, step)
  if jax.process_index() == 0:
    print(json.dumps(result))


def import_hf_command(argv: list[str]) -> None:
  del argv
  logging.set_verbosity(logging.WARNING)
  if not _FROM.value or not _TO.value:
    raise ConfigError("--from/--to", "give both: meshtrain import-hf --from HF_DIR --to WORKDIR")
  cfg = _CONFIG.value
  _use_simulated_devices(cfg)
  distributed.initialize(cfg.distributed)
  workdir = importer.import_hf(cfg, _FROM.value, _TO.value)
  if jax.process_index() == 0:
    print(f"imported {_FROM.value} into {workdir}; fine-tune with "
          f"`meshtrain train --config configs/finetune_hf.py:{workdir}`")


def _saved_run():
  """The config of --workdir (--config.* flags apply) and its checkpoint step --step."""
  if not _WORKDIR.value:
    raise ConfigError("--workdir", "give the workdir of a run (or of import-hf)")
  overrides = config_flags.get_override_values(flags.FLAGS["config"])
  cfg = saved_run.load_config(_WORKDIR.value, overrides)
  step = saved_run.checkpoint_step(_WORKDIR.value, _STEP.value)
  _use_simulated_devices(cfg)
  distributed.initialize(cfg.distributed)
  return cfg, step


def export_hf_command(argv: list[str]) -> None:
  del argv
  logging.set_verbosity(logging.WARNING)
  if not _TO.value:
    raise ConfigError("--to", "give the directory to write: "
                      "meshtrain export-hf --workdir W --to DIR")
  exporter.check_target(_TO.value)
  cfg, step = _saved_run()
  setup = build(cfg)
  params = saved_run.load_params(_WORKDIR.value, step, setup.spec.abstract_params,
                                 setup.shardings.params)
  files = exporter.export_hf(cfg, params, _WORKDIR.value, _TO.value, dtype=_DTYPE.value,
                             max_shard_bytes=_MAX_SHARD_MB.value * 2**20)
  if jax.process_index() == 0:
    print(f"exported step {step} of {_WORKDIR.value} to {_TO.value}: {', '.join(files)}")


def _prompt_texts() -> list[str]:
  if bool(_PROMPT.value is not None) == bool(_PROMPTS.value):
    raise ConfigError("--prompt", "give either --prompt TEXT or --prompts FILE (one prompt a line)")
  if _PROMPT.value is not None:
    return [_PROMPT.value]
  try:
    texts = [line for line in Path(_PROMPTS.value).read_text().splitlines() if line.strip()]
  except (OSError, UnicodeDecodeError) as error:
    raise ConfigError("--prompts", f"cannot read {_PROMPTS.value} ({error})") from None
  if not texts:
    raise ConfigError("--prompts", f"{_PROMPTS.value} holds no prompt")
  return texts


def generate_command(argv: list[str]) -> None:
  del argv
  logging.set_verbosity(logging.WARNING)
  texts = _prompt_texts()
  sampling = generate.Sampling(_TEMPERATURE.value, _TOP_K.value, _TOP_P.value)
  sampling.check()
  if _MAX_TOKENS.value < 1:
    raise ConfigError("--max_tokens", f"{_MAX_TOKENS.value} must be >= 1")
  cfg, step = _saved_run()
  setup = build(cfg)
  tokenizer = tokenizers.for_config(cfg)
  prompts = generate.prompt_ids(tokenizer, texts, cfg.model.vocab_size)
  generator = generate.from_workdir(_WORKDIR.value, step, setup, eos_id=tokenizer.eos_id)
  outputs = generator(prompts, _MAX_TOKENS.value, sampling, _SEED.value)
  if jax.process_index():
    return
  for text, prompt, tokens in zip(texts, prompts, outputs):
    completion = tokenizer.decode(tokens)
    if _JSON.value:
      print(json.dumps({"prompt_tokens": prompt, "tokens": tokens, "text": completion}))
    else:
      print(f"{text}{completion}\n")


def launch_command(argv: list[str]) -> None:
  command = argv[1:]
  if not command or command[0] not in COMMANDS or command[0] == "launch":
    raise ConfigError("launch", "give the command after --, e.g. "
                      "`meshtrain launch --num_processes 2 -- train --config configs/tiny.py`")
  sys.exit(launch.launch(command, _NUM_PROCESSES.value, _DEVICES_PER_PROCESS.value))


COMMANDS = {"train": train_command, "plan": plan_command, "schedule": schedule_command,
            "launch": launch_command, "prepare": prepare_command,
            "eval": eval_command, "import-hf": import_hf_command,
            "export-hf": export_hf_command, "generate": generate_command}


def _guarded(command):
  def main(argv):
    try:
      command(argv)
    except ConfigError as error:
      print(f"error: {error}", file=sys.stderr)
      sys.exit(2)
    except TrainingHalted as error:
      print(f"stopped: {error}", file=sys.stderr)
      sys.exit(3)
  return main


def run() -> None:
  """The `meshtrain` console script."""
  if len(sys.argv) < 2 or sys.argv[1] not in COMMANDS:
    print(f"usage: meshtrain {{{'|'.join(COMMANDS)}}} [--flags]   (--helpfull for flags)",
          file=sys.stderr)
    sys.exit(2)
  name = sys.argv[1]
  app.run(_guarded(COMMANDS[name]), argv=[f"meshtrain {name}", *sys.argv[2:]])


if __name__ == "__main__":
  run()
