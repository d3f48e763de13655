"""`meshtrain COMMAND [--flags]`: one absl program per command.

  meshtrain train --config configs/tiny.py --config.steps=300 --config.mesh.data=8
  meshtrain launch --num_processes 2 --devices_per_process 4 -- train --config configs/tiny.py
  meshtrain verify --config configs/fsdp.py:tiny --config.simulate_devices=8
"""

import dataclasses
import errno
import json
import math
import os
import re
import shlex
import sys
from pathlib import Path
from typing import NoReturn

import jax
from absl import app, flags, logging
from ml_collections import config_flags

import meshtrain.config
from meshtrain import (distributed, flag_parsing, generate, gpu_targets, hf_import, launch, usage,
                       validate, workdir as saved_run)
from meshtrain.analysis import selfcheck
from meshtrain.checkpoint import storage_error
from meshtrain.data import tokenizer as tokenizers
from meshtrain.data.prepare import INPUT_FORMATS, TEXT_FIELD, prepare
from meshtrain.errors import ConfigError, StorageError, TrainingHalted
from meshtrain.hf import exporter, importer
from meshtrain.parallel.pipeline import draw, measures, schedule as schedules
from meshtrain.planner import clusters, search, verdict
from meshtrain.planner.plan import format_plan, plan
from meshtrain.train import plot
from meshtrain.train.evaluate import evaluate_checkpoint
from meshtrain.train.loop import train
from meshtrain.train.parallelize import from_stage_slots
from meshtrain.train.relayout import read_saved
from meshtrain.train.setup import build, with_packing
from meshtrain.train.state_memory import device_memory

# The args ml_collections reads the --config.KEY overrides from: this command's
# own, set by `_parse_flags` (not sys.argv, which holds launch's command after --
# and is read at import when --config is not named).
_OVERRIDE_ARGV: list[str] = []
_GIVEN_ARGV: list[str] = []  # the command line as given (before --config is added), for FLAGS_READ
_CONFIG = config_flags.DEFINE_config_file(
    "config", default=meshtrain.config.__file__,
    help_string="A config file with get_config(); `file.py:arg` passes arg. "
                "Override any key with --config.KEY=VALUE.",
    lock_config=True, sys_argv=_OVERRIDE_ARGV)
_JSON = flags.DEFINE_bool("json", False, "plan: print JSON instead of tables; generate: one "
                            "JSON object per prompt")
_COMPILE = flags.DEFINE_bool("compile", False, "plan: also compile the step and read its memory "
                             "and collectives (on --devices simulated CPU devices if set)")
_DEVICES = flags.DEFINE_integer("devices", None, "plan: devices to plan for (default: the "
                                "config's simulate_devices, else the devices present)")
_TARGET = flags.DEFINE_string("target", None, "plan: compile the step here for a GPU cluster "
                              "and read its program, KIND:HOSTSxDEVICES (e.g. h100:1x8, h200:8x8; "
                              f"KIND: {', '.join(gpu_targets.KINDS)} or a GpuTargetConfigProto "
                              ".txtpb file)")
_SEARCH = flags.DEFINE_bool("search", False, "plan: search meshes, ZeRO stage, recomputation and "
                            "microbatches for --devices of --cluster, fastest first")
_CLUSTER = flags.DEFINE_string("cluster", "h100", "plan: the devices to judge the plan against "
                               "(default: the accelerators present, else h100); --search: to "
                               "search for; a preset "
                               f"({', '.join(clusters.PRESETS)}) or a JSON file with the "
                               "same fields")
_TOP = flags.DEFINE_integer("top", 5, "plan --search: how many configurations to print")
_GLOBAL_BATCH = flags.DEFINE_integer("global_batch", None, "plan --search: sequences per step "
                                     "(default: the config's)")
_SEQ_LEN = flags.DEFINE_integer("seq_len", None, "plan --search: tokens per sequence "
                                "(default: the config's)")
_MESH = flags.DEFINE_string("mesh", None, "plan --search: explain one layout, e.g. "
                            "data=64,pipeline=16,tensor=8: its prediction, rank and what the "
                            "first choice does differently")
_STAGES = flags.DEFINE_integer("stages", 4, "schedule: pipeline stages")
_MICROBATCHES = flags.DEFINE_integer("microbatches", 8, "schedule: microbatches per step")
_SCHEDULE = flags.DEFINE_enum("schedule", "1f1b", schedules.SCHEDULE_NAMES, "schedule: which one")
_VIRTUAL = flags.DEFINE_integer("virtual", 1, "schedule: model chunks per stage (interleaved)")
_COSTS = flags.DEFINE_string("costs", "1,1,1", "schedule: cost of F, B (input gradient) and "
                             "W (weight gradient) of one stage, e.g. 1,1,1 or 1,2,0 (Megatron)")
_OUT = flags.DEFINE_string("out", None, "schedule: write a Gantt chart PNG here; prepare: the "
                           "directory to create; plot: the picture (default WORKDIR/metrics.png)")
_INPUT = flags.DEFINE_multi_string("input", [], "prepare: text, JSONL or Parquet files, globs or "
                                   "directories (more paths may follow)")
_FORMAT = flags.DEFINE_enum("format", "text", INPUT_FORMATS, "prepare: text: documents; chat: "
                            "JSONL conversations ({\"messages\": [...]} a line) rendered with the "
                            "--tokenizer directory's chat template, the assistant's turns masked "
                            "in for the loss")
_TOKENIZER = flags.DEFINE_string("tokenizer", "bytes", "prepare: bytes | PATH to a tokenizer.json "
                                 "(or its directory, or a prepared corpus) | train:N (a BPE of N "
                                 "ids); --format chat: a Hugging Face tokenizer directory")
_TEXT_FIELD = flags.DEFINE_string("text_field", TEXT_FIELD, "prepare: the JSONL field / Parquet "
                                  "column holding the text")
_SPLIT_BLANK_LINES = flags.DEFINE_bool("split_blank_lines", False, "prepare: blank lines separate "
                                       "documents in text files (default: one document per file)")
_VAL_FRACTION = flags.DEFINE_float("val_fraction", 0.05, "prepare: share of the tokens held out "
                                   "for evaluation")
_WORKDIR = flags.DEFINE_string("workdir", None, "eval, export-hf, generate, plot: the run's workdir "
                               "(its saved config; --config.KEY=VALUE flags change it, e.g. the "
                               "mesh)")
_STEP = flags.DEFINE_integer("step", None, "eval, export-hf, generate: the checkpoint "
                             "step (default: the newest)")
_VERIFY_STEPS = flags.DEFINE_integer("verify_steps", 2, "verify: train steps to compare")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", 2, "launch: processes to start")
_DEVICES_PER_PROCESS = flags.DEFINE_integer(
    "devices_per_process", 0, "launch: simulated CPU devices per process (0: the config's)")
_MAX_RESTARTS = flags.DEFINE_integer(
    "max_restarts", 0, "launch: when a process fails, stop the others and start them all again "
    "(train resumes from its newest checkpoint), up to this many times; bad input (exit 2) is "
    "not restarted")

# import-hf / export-hf / generate
_FROM = flags.DEFINE_string("from", None, "import-hf: a Hugging Face Llama directory")
_TO = flags.DEFINE_string("to", None, "import-hf: the workdir to write; export-hf: the "
                          "Hugging Face directory to write")
_DTYPE = flags.DEFINE_string("dtype", "", "export-hf: float32 | bfloat16 | float16 | float8 "
                             "(projections in e4m3 with a scale per 128 x 128 block, the rest "
                             "bfloat16; default: the imported model's, else float32)")
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


def checked_config(writes_workdir: bool = False):
  """`--config` after `validate.check_config` (and `check_workdir` for a command that writes)."""
  cfg = _CONFIG.value
  validate.check_config(cfg)
  if writes_workdir:
    validate.check_workdir(cfg)
  return cfg


def joined_config(writes_workdir: bool = False):
  """The checked config of a command that runs on devices: simulated devices set
  up, the job joined, and the config checked against the devices present."""
  cfg = checked_config(writes_workdir)
  _use_simulated_devices(cfg)
  distributed.initialize(cfg.distributed)
  validate.check_devices(cfg, jax.device_count(), jax.devices()[0].platform)
  return cfg


def train_command(argv: list[str]) -> None:
  del argv
  logging.set_verbosity(logging.WARNING)  # keep the terminal to the progress bar
  cfg = joined_config(writes_workdir=True)
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
  cfg = checked_config()
  if _DEVICES.value is not None and _DEVICES.value < 1:
    raise ConfigError("--devices", f"is {_DEVICES.value}; give the number of devices to plan for")
  if _SEARCH.value:
    _search(cfg)
    return
  if _TARGET.value is not None:
    _plan_target(cfg)
    return
  searching = [f"--{name}" for name in ("mesh", "top", "global_batch", "seq_len")
               if flags.FLAGS[name].present]
  if searching:
    raise ConfigError(searching[0], "is read by plan --search only; add --search, or plan the "
                      "config's own layout with --config.mesh.* and --config.global_batch")
  if _COMPILE.value and _DEVICES.value:
    _check_as_config("--devices", "simulate_devices", _DEVICES.value,
                     "; or plan more devices without --compile, which only does arithmetic")
    validate.check_devices(cfg, _DEVICES.value)  # before simulating that many devices
    cfg.simulate_devices = _DEVICES.value
  _use_simulated_devices(cfg)
  devices = _DEVICES.value or cfg.simulate_devices or jax.device_count()
  validate.check_devices(cfg, devices, jax.devices()[0].platform if _COMPILE.value else None)
  report = plan(with_packing(cfg), devices, _COMPILE.value)
  report["verdict"] = _verdict(cfg, report)
  print(json.dumps(report, indent=2) if _JSON.value else
        f"{format_plan(report)}\n\n{report['verdict']['text']}")


def _verdict(cfg, report: dict) -> dict:
  """`verdict.verdict` against --cluster when given, else the devices present
  where they are accelerators, else an H100 (--cluster's default)."""
  local = jax.devices()[0]
  memory = None if flags.FLAGS["cluster"].present else device_memory(local)
  if memory and local.platform != "cpu":
    capacity, device = memory, f"one {local.device_kind}"
  else:
    cluster = clusters.load(_CLUSTER.value)
    capacity = cluster.hbm_bytes * cluster.usable_memory
    device = f"one {cluster.name} ({cluster.hbm_bytes / 1e9:.0f} GB; --cluster names another)"
  return verdict.verdict(report["analytic"]["memory_bytes"], report["devices"], capacity, device,
                         _planned_config_args(cfg), _CLUSTER.value, cfg.remat)


def _plan_target(cfg) -> None:
  """plan --target: the step compiled for a GPU cluster on this machine."""
  target = gpu_targets.parse(_TARGET.value)
  if _COMPILE.value:
    raise ConfigError("--compile", "plan --target compiles for the target's GPUs itself; remove "
                      "--compile (which compiles for simulated CPU devices)")
  if _CLUSTER.present:
    raise ConfigError("--cluster", f"plan --target judges against the target's own GPUs "
                      f"({target}); remove --cluster")
  if _DEVICES.value is not None and _DEVICES.value != target.num_devices:
    raise ConfigError("--devices", f"is {_DEVICES.value}, but --target {target} has "
                      f"{target.num_devices} devices; remove --devices")
  gpu_targets.devices(target)  # before anything starts a backend on this machine
  validate.check_devices(cfg, target.num_devices, "gpu")
  report = plan(with_packing(cfg), target.num_devices, compile_step=False, target=target)
  measured = report["measured"]
  report["verdict"] = verdict.verdict(
      measured["memory_bytes"], target.num_devices, measured["usable_memory_bytes"],
      f"one {target.device_kind} (by the compiled program)", _planned_config_args(cfg),
      target.name if target.name in clusters.PRESETS else "h100", cfg.remat)
  print(json.dumps(report, indent=2) if _JSON.value else
        f"{format_plan(report)}\n\n{report['verdict']['text']}")


def _check_as_config(flag: str, key: str, value, fix: str = "") -> None:
  """`value`, given by `flag`, by the rule of the config key it sets
  (`validate.RULES[key]`); `fix` ends the message."""
  problem = value is not None and validate.RULES[key](value)
  if problem:
    raise ConfigError(flag, f"{problem} (as config.{key}){fix}")


def _costs(text: str) -> tuple[float, float, float]:
  try:
    costs = tuple(float(c) for c in text.split(","))
  except ValueError:
    costs = ()
  if len(costs) != 3 or not all(map(math.isfinite, costs)) or min(costs) < 0 or costs[0] <= 0:
    raise ConfigError("--costs", f"{text!r} is not three costs F,B,W (F > 0, B and W >= 0), "
                      "e.g. --costs=1,1,1")
  return costs


def _planned_config_args(cfg) -> str:
  """The `train` flags of the config a search plans: the --config file, the
  --config.* overrides given (the search's own come after them) and the
  batch and length it planned for."""
  overrides = {**config_flags.get_override_values(flags.FLAGS["config"]),
               "global_batch": cfg.global_batch, "seq_len": cfg.seq_len}
  return " ".join([f"--config={config_flags.get_config_filename(flags.FLAGS['config'])}",
                   *(f"--config.{key}={shlex.quote(str(value))}"
                     for key, value in overrides.items())])


def _search(cfg) -> None:
  if not _DEVICES.value or _DEVICES.value < 1:
    raise ConfigError("--devices", "plan --search needs the number of devices to plan for, "
                      "e.g. --devices 1024")
  for flag in (_COMPILE, _TARGET):
    if flag.present:
      raise ConfigError(f"--{flag.name}", "is read by plan without --search (it compiles the "
                        "config's own layout); remove it, or plan one layout with "
                        "--config.mesh.*")
  chosen = [name for name in flags.FLAGS if name.startswith("config.") and
            flags.FLAGS[name].present and search.chooses(name.removeprefix("config."))]
  if chosen:
    raise ConfigError(chosen[0], "plan --search chooses it itself (with the mesh, ZeRO, "
                      "recomputation, accumulation, the pipeline and the expert and sequence "
                      "layouts), so this would do nothing; remove it, or plan this one layout "
                      "without --search (--search --mesh=data=8,... ranks one mesh among the "
                      "search's)")
  if _TOP.value < 1:
    raise ConfigError("--top", f"is {_TOP.value}; give a positive number")
  for flag in (_GLOBAL_BATCH, _SEQ_LEN):  # they replace the config keys of their names
    _check_as_config(f"--{flag.name}", flag.name, flag.value)
  with cfg.unlocked():
    cfg.global_batch = _GLOBAL_BATCH.value or cfg.global_batch
    cfg.seq_len = _SEQ_LEN.value or cfg.seq_len
  cluster = clusters.load(_CLUSTER.value)
  config_arg = _planned_config_args(cfg)
  if _MESH.value is not None:
    explained = search.explain(cfg, _DEVICES.value, cluster,
                               search.parse_mesh(_MESH.value, _DEVICES.value))
    if _JSON.value:
      print(json.dumps({key: value.as_dict(config_arg) if isinstance(value, search.Estimate)
                        else value for key, value in explained.items()}, indent=2))
    else:
      print(explained["text"])
    return
  results, fitting, _ = search.search(cfg, _DEVICES.value, cluster, _TOP.value)
  if _JSON.value:
    print(json.dumps({"cluster": dataclasses.asdict(cluster), "devices": _DEVICES.value,
                      "fitting": fitting,
                      "kernel_efficiency": search.calibration.KERNEL_EFFICIENCY,
                      "results": [e.as_dict(config_arg) for e in results]}, indent=2))
  elif not results:
    print(f"nothing fits: no mesh of {_DEVICES.value} x {cluster.name} holds this model at "
          f"global_batch={cfg.global_batch}, seq_len={cfg.seq_len}")
  else:
    print(search.format_search(results, fitting, cluster, _DEVICES.value, config_arg))


# The most stage-ticks `meshtrain schedule` builds and prints, and the most ops
# it draws with --out (a box and a label each), in seconds.
MAX_SCHEDULE_CELLS = 300_000
MAX_CHART_OPS = 3_000


def _check_schedule_flags() -> None:
  """The schedule the flags name, as `schedules.check` sees it (the flag of its
  wrong argument named), then the size of what this command prints and draws."""
  arguments = {"name": _SCHEDULE, "num_stages": _STAGES, "num_microbatches": _MICROBATCHES,
               "num_chunks": _VIRTUAL}
  try:
    schedules.check(**{argument: flag.value for argument, flag in arguments.items()})
  except schedules.ArgumentError as error:
    raise ConfigError(f"--{arguments[error.argument].name}", str(error)) from None
  sizes = (_STAGES, _MICROBATCHES, _VIRTUAL)
  stages, microbatches, virtual = (flag.value for flag in sizes)
  cells = stages * (3 * virtual * microbatches + 2 * stages)  # about ticks x stages
  if cells > MAX_SCHEDULE_CELLS:
    largest = max(sizes, key=lambda flag: flag.value)
    raise ConfigError(f"--{largest.name}", f"{stages} stages x {virtual} chunks x {microbatches} "
                      f"microbatches make a table of about {cells:,} stage-ticks, over the "
                      f"{MAX_SCHEDULE_CELLS:,} this command prints; give fewer")
  ops = 3 * stages * virtual * microbatches  # F, B and W
  if _OUT.value and ops > MAX_CHART_OPS:
    raise ConfigError("--out", f"a chart of {stages} stages x {virtual} chunks x {microbatches} "
                      f"microbatches has {ops:,} ops, over the {MAX_CHART_OPS:,} it draws; give "
                      "fewer, or leave out --out (the table is printed)")


def _check_chart_path() -> None:
  if _OUT.value is None:
    return
  out = Path(_OUT.value).absolute()
  if not _OUT.value or out.is_dir():
    raise ConfigError("--out", f"{_OUT.value!r} is not a file name; give the chart's file, "
                      "e.g. --out schedule.png")
  if out.suffix.removeprefix(".").lower() not in draw.FORMATS:
    raise ConfigError("--out", f"{out.name} has no image extension; end it with one of "
                      f"{', '.join('.' + f for f in draw.FORMATS)}")
  if not out.parent.is_dir():
    raise ConfigError("--out", f"folder {out.parent} does not exist; create it or write the "
                      "chart elsewhere")


def schedule_command(argv: list[str]) -> None:
  del argv
  costs = _costs(_COSTS.value)
  _check_chart_path()
  _check_schedule_flags()
  table = schedules.build(_SCHEDULE.value, _STAGES.value, _MICROBATCHES.value, _VIRTUAL.value)
  summary = measures.describe(table, costs)
  if _OUT.value:
    try:
      draw.draw_gantt(table, _OUT.value, costs)
    except OSError as error:
      raise ConfigError("--out", f"cannot write {_OUT.value} ({error.strerror or error}); "
                        "write the chart elsewhere") from None
    summary["chart"] = _OUT.value
  if _JSON.value:
    print(json.dumps(summary, indent=2))
    return
  print(measures.to_text(table))
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
  meta = prepare(inputs, _TOKENIZER.value, _OUT.value, input_format=_FORMAT.value,
                 text_field=_TEXT_FIELD.value, split_blank_lines=_SPLIT_BLANK_LINES.value,
                 val_fraction=_VAL_FRACTION.value)
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
  _check_import_flags()
  cfg = joined_config()
  workdir = hf_import.import_hf(cfg, _FROM.value, _TO.value)
  if jax.process_index() == 0:
    print(f"imported {_FROM.value} into {workdir}; fine-tune with "
          f"`meshtrain train --config configs/finetune_hf.py:{workdir}`")
    for note in (importer.balancing_note(Path(_FROM.value), cfg.model.moe),
                 importer.left_out_note(Path(_FROM.value), cfg.model.mtp_layers)):
      if note:
        print(note)


def _check_import_flags() -> None:
  if not _FROM.value or not _TO.value:
    raise ConfigError("--from/--to", "give both: meshtrain import-hf --from HF_DIR --to WORKDIR")


def _saved_config():
  """The checked config of --workdir (--config.* flags apply) and its checkpoint step --step."""
  if not _WORKDIR.value:
    raise ConfigError("--workdir", "give the workdir of a run (or of import-hf)")
  overrides = config_flags.get_override_values(flags.FLAGS["config"])
  cfg = saved_run.load_config(_WORKDIR.value, overrides)
  validate.check_config(cfg)
  return cfg, saved_run.checkpoint_step(_WORKDIR.value, _STEP.value)


def _saved_run():
  """`_saved_config` with its devices set up, the job joined and the config checked on them."""
  cfg, step = _saved_config()
  _use_simulated_devices(cfg)
  distributed.initialize(cfg.distributed)
  validate.check_devices(cfg, jax.device_count(), jax.devices()[0].platform)
  return cfg, step


def export_hf_command(argv: list[str]) -> None:
  del argv
  logging.set_verbosity(logging.WARNING)
  _check_export_flags()
  cfg, step = _saved_run()
  setup = build(cfg)
  params = from_stage_slots(cfg, read_saved(saved_run.load_params, _WORKDIR.value, step, cfg,
                                            setup.spec.abstract_params, setup.shardings.params))
  model_state = read_saved(saved_run.load_model_state, _WORKDIR.value, step, cfg,
                           setup.abstract_state().model_state, setup.shardings.model_state)
  model_state = None if model_state is None else from_stage_slots(cfg, model_state)
  files = exporter.export_hf(cfg, params, _WORKDIR.value, _TO.value, model_state=model_state,
                             dtype=_DTYPE.value, max_shard_bytes=_MAX_SHARD_MB.value * 2**20)
  if jax.process_index() == 0:
    print(f"exported step {step} of {_WORKDIR.value} to {_TO.value}: {', '.join(files)}")


def _check_export_flags() -> None:
  if not _TO.value:
    raise ConfigError("--to", "give the directory to write: "
                      "meshtrain export-hf --workdir W --to DIR")
  exporter.check_target(_TO.value)
  if _MAX_SHARD_MB.value < 1:
    raise ConfigError("--max_shard_mb", f"is {_MAX_SHARD_MB.value}; give the largest file in "
                      "MB, 1 or more (default 5120)")


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


def _check_generate_flags() -> list[str]:
  """generate's flags but the sampling's (`_sampling`); returns the prompts."""
  texts = _prompt_texts()
  if _MAX_TOKENS.value < 1:
    raise ConfigError("--max_tokens", f"{_MAX_TOKENS.value} must be >= 1")
  if not 0 <= _SEED.value < 2**32:
    raise ConfigError("--seed", f"is {_SEED.value}; give a seed in [0, 2**32), as config.seed")
  return texts


def _sampling(cfg) -> generate.Sampling:
  sampling = generate.Sampling(_TEMPERATURE.value, _TOP_K.value, _TOP_P.value)
  sampling.check(cfg.model.vocab_size)
  return sampling


def generate_command(argv: list[str]) -> None:
  del argv
  logging.set_verbosity(logging.WARNING)
  texts = _check_generate_flags()
  cfg, step = _saved_run()
  sampling = _sampling(cfg)
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


MAX_VERIFY_STEPS = 1000  # each is a step of both programs, on these devices


def _check_verify_flags() -> None:
  if not 1 <= _VERIFY_STEPS.value <= MAX_VERIFY_STEPS:
    raise ConfigError("--verify_steps", f"is {_VERIFY_STEPS.value}; compare 1 to "
                      f"{MAX_VERIFY_STEPS} train steps (a few show a difference)")


def verify_command(argv: list[str]) -> None:
  """The config's sharded step against the same step unsharded under plain jit;
  exits 1 when they differ by more than float32 reordering explains."""
  del argv
  logging.set_verbosity(logging.WARNING)
  _check_verify_flags()
  cfg = joined_config()
  report = selfcheck.verify_config(cfg, _VERIFY_STEPS.value)
  print(report.format())
  if not report.ok():
    sys.exit(1)


def plot_command(argv: list[str]) -> None:
  del argv
  if not _WORKDIR.value:
    raise ConfigError("--workdir", "give the workdir of a run: meshtrain plot --workdir runs/tiny")
  out = plot.draw(_WORKDIR.value, _OUT.value or Path(_WORKDIR.value) / "metrics.png")
  print(f"plotted {Path(_WORKDIR.value) / 'metrics.jsonl'}: {out}")


def config_command(argv: list[str]) -> None:
  del argv
  print(usage.config_text(_CONFIG.value))


def launch_command(argv: list[str]) -> None:
  command = argv[1:]
  if not command or command[0] not in COMMANDS or command[0] == "launch":
    raise ConfigError("launch", "give the command after --, e.g. "
                      "`meshtrain launch --num_processes 2 -- train --config configs/tiny.py`")
  if command[0] not in LAUNCHED:
    raise ConfigError("launch", f"{command[0]} runs in one process and joins no job; run "
                      f"`meshtrain {command[0]}` itself (launch runs {', '.join(LAUNCHED)})")
  num_processes, devices_per_process = _NUM_PROCESSES.value, _DEVICES_PER_PROCESS.value
  if not 1 <= num_processes <= MAX_PROCESSES:
    raise ConfigError("--num_processes", f"is {num_processes}; start 1 to {MAX_PROCESSES} "
                      "processes (all of them on this machine)")
  # 0 keeps the config's own count
  _check_as_config("--devices_per_process", "simulate_devices", devices_per_process)
  max_restarts = _MAX_RESTARTS.value  # read before the command's own flags are parsed
  if max_restarts < 0:
    raise ConfigError("--max_restarts", f"is {max_restarts}; give 0 (none) or more")
  cfg = _check_launched(command, num_processes, devices_per_process)
  sys.exit(launch.launch(command, num_processes, devices_per_process, max_restarts,
                         workdir=cfg.workdir if command[0] == "train" else None,
                         log_every=cfg.log_every))


def _check_launched(command: list[str], num_processes: int, devices_per_process: int):
  """The launched command's flags and config, checked here once rather than
  failing in every process after they have joined; returns the config."""
  argv = flag_parsing.with_config(command, meshtrain.config.__file__)
  rest = _parse_flags([f"meshtrain {argv[0]}", *argv[1:]])
  launched = COMMANDS[argv[0]]
  _check_flags_read(launched, command)
  if len(rest) > 1:
    raise ConfigError(argv[0], f"unexpected argument {rest[1]!r} after `launch -- {argv[0]}`; "
                      "flags start with -- (a config file is --config FILE)")
  for name in ("num_processes", "process_id", "coordinator_address"):
    if f"config.distributed.{name}" in flags.FLAGS and flags.FLAGS[
        f"config.distributed.{name}"].present:
      raise ConfigError(f"config.distributed.{name}", "is set by launch for each process; "
                        "remove it (--num_processes before -- sets the count)")
  LAUNCHED[argv[0]]()  # the command's own flags
  if launched in (eval_command, generate_command, export_hf_command):
    cfg, _ = _saved_config()
  else:
    cfg = _CONFIG.value
  cfg.distributed.update(num_processes=num_processes, process_id=0,
                         coordinator_address="127.0.0.1:1")  # what launch passes each process
  validate.check_config(cfg)
  if launched is train_command:
    validate.check_workdir(cfg)
  if launched is import_hf_command:  # the model it makes, as each process will
    hf_import.prepare(cfg, Path(_FROM.value), Path(_TO.value).absolute())
  if launched is generate_command:
    _sampling(cfg)
  cfg.simulate_devices = devices_per_process or cfg.simulate_devices
  if cfg.simulate_devices:
    validate.check_devices(cfg, cfg.simulate_devices * num_processes)
  return cfg


# The commands launch starts (those that join a job), each with its flags' own
# check, run once before any process starts; the most processes it starts.
LAUNCHED = {"train": lambda: None, "eval": lambda: None, "verify": _check_verify_flags,
            "generate": _check_generate_flags, "import-hf": _check_import_flags,
            "export-hf": _check_export_flags}
MAX_PROCESSES = 64
COMMANDS = {"train": train_command, "plan": plan_command, "schedule": schedule_command,
            "launch": launch_command, "prepare": prepare_command,
            "eval": eval_command, "import-hf": import_hf_command,
            "export-hf": export_hf_command, "generate": generate_command,
            "verify": verify_command, "plot": plot_command, "config": config_command}
# Commands that take positional arguments: launch's command after --, prepare's inputs.
POSITIONAL_ARGS = (launch_command, prepare_command)
# The flags of this module each command reads; a flag it does not read is an error, not a no-op.
# "config": the --config file; "config.": its --config.KEY overrides.
FLAGS_READ = {
    train_command: ("config", "config."),
    plan_command: ("config", "config.", "json", "compile", "devices", "target", "search",
                   "cluster", "top", "global_batch", "seq_len", "mesh"),
    schedule_command: ("stages", "microbatches", "schedule", "virtual", "costs", "out", "json"),
    prepare_command: ("input", "format", "tokenizer", "text_field", "split_blank_lines",
                      "val_fraction", "out"),
    eval_command: ("config.", "workdir", "step"),
    import_hf_command: ("config", "config.", "from", "to"),
    export_hf_command: ("config.", "workdir", "step", "to", "dtype", "max_shard_mb"),
    generate_command: ("config.", "workdir", "step", "prompt", "prompts", "max_tokens",
                       "temperature", "top_k", "top_p", "seed", "json"),
    verify_command: ("config", "config.", "verify_steps"),
    launch_command: ("num_processes", "devices_per_process", "max_restarts"),
    plot_command: ("workdir", "out"),
    config_command: ("config", "config."),
}
OWN_FLAGS = [name for name, holder in list(globals().items())
             if name.startswith("_") and isinstance(holder, flags.FlagHolder)]


def _check_flags_read(command, argv: list[str]) -> None:
  """Each flag of this module given in `argv` (up to a --) is one `command` reads."""
  argv = argv[:argv.index("--")] if "--" in argv else argv
  read, name = FLAGS_READ[command], command.__name__.removesuffix("_command").replace("_", "-")
  given = [globals()[holder].name for holder in OWN_FLAGS
           if globals()[holder].present and globals()[holder].name != "config"]
  given += [f for f in flags.FLAGS if f.startswith("config.") and flags.FLAGS[f].present]
  if any(re.match(r"--?config(=|$)", arg) for arg in argv):
    given.append("config")
  for flag in given:
    if flag not in read and not (flag.startswith("config.") and "config." in read):
      where = ("it reads the run's saved config; change its keys with --config.KEY=VALUE"
               if flag == "config" and "config." in read else f"see `meshtrain {name} --help`")
      raise ConfigError(f"--{flag}", f"is not read by `meshtrain {name}`, so it would do "
                        f"nothing; remove it ({where})")


def _guarded(command):
  def main(argv):
    try:
      _check_flags_read(command, _GIVEN_ARGV)
      if command not in POSITIONAL_ARGS and len(argv) > 1:
        raise ConfigError(argv[0].split()[-1], f"unexpected argument {argv[1]!r}; flags start "
                          f"with -- (a config file is --config {argv[1]})")
      command(argv)
    except StorageError as error:
      _fail(error, at_once=True)
    except ConfigError as error:
      _fail(error)
    except TrainingHalted as error:
      print(f"stopped: {error}", file=sys.stderr)
      sys.exit(3)
    except OSError as error:
      failure = _os_failure(command, error)
      if failure is None:  # in no path a flag names: its own traceback says where
        raise
      _fail(failure, at_once=isinstance(failure, StorageError))
  return main


def _paths(command) -> list[tuple[str, str, bool]]:
  """(flag, path, whether `command` writes there) for the paths its flags name
  that it reads or writes past its own checks. train's workdir is apart
  (`_os_failure`); prepare's inputs and tokenizer, generate's prompts and
  the data of a run report their own errors."""
  cfg = _CONFIG.value
  return {
      train_command: [("config.checkpoint.restore_from", cfg.checkpoint.restore_from, False),
                      ("config.init_from", cfg.init_from.removeprefix("hf:"), False)],
      plan_command: [("--cluster", _CLUSTER.value, False)],
      schedule_command: [("--out", _OUT.value, True)],
      prepare_command: [("--out", _OUT.value, True)],
      eval_command: [("--workdir", _WORKDIR.value, False)],
      generate_command: [("--workdir", _WORKDIR.value, False)],
      export_hf_command: [("--to", _TO.value, True), ("--workdir", _WORKDIR.value, False)],
      import_hf_command: [("--to", _TO.value, True), ("--from", _FROM.value, False)],
  }.get(command, [])


def _os_failure(command, error: OSError) -> ConfigError | None:
  """`error` as one line naming the flag whose path it happened in, or None.
  Only train's workdir is the disk of a running job (StorageError): train
  reads its inputs when it starts, each with its own check, so an error that
  names no file (a write to an open file) is a write there."""
  reason = error.strerror or str(error)
  paths = [p for p in (error.filename, error.filename2) if isinstance(p, (str, bytes, os.PathLike))]
  if command is train_command:
    workdir = Path(_CONFIG.value.workdir)
    if not paths or any(_within(path, workdir) for path in paths):
      return storage_error("config.workdir", f"writing into {workdir}", reason,
                           workdir / "checkpoints")
  # These only come from writing (shutil names the source file first).
  writing = error.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EFBIG)
  for path in paths:
    for flag, place, writes in _paths(command):
      if place and (writes or not writing) and _within(path, place):
        return ConfigError(flag, f"{'writing' if writes else 'reading'} {os.fsdecode(path)} "
                           f"failed ({reason})")
  return None


def _within(path, folder) -> bool:
  """Whether `path` is `folder` or inside it."""
  path, folder = (os.path.abspath(os.fsdecode(p)) for p in (path, folder))
  return os.path.commonpath([path, folder]) == folder


def _fail(error: ConfigError, at_once: bool = False) -> NoReturn:
  print(f"error: {error}", file=sys.stderr, flush=True)
  if at_once:  # a failed disk: skip exit-time cleanups that would fail on it too
    sys.stdout.flush()
    os._exit(2)
  sys.exit(2)


def _parse_flags(argv: list[str]) -> list[str]:
  """absl's flag parsing, with each bad flag reported as one `error:` line (exit 2)."""
  try:
    return flag_parsing.parse(argv, _CONFIG, _OVERRIDE_ARGV)
  except ConfigError as error:
    _fail(error)


def _help(argv: list[str]) -> None:
  """`meshtrain`, `meshtrain --help` and `meshtrain help` list the commands;
  `meshtrain COMMAND --help` (or `help COMMAND`) lists its flags; both exit 0."""
  own = argv[:argv.index("--")] if "--" in argv else argv  # after --: launch's command
  if own[:1] == ["help"] and own[1:2] and own[1] in COMMANDS:
    own = [own[1], "--help"]
  if not own or own[0] in ("help", *usage.HELP_FLAGS):
    print(usage.commands_text())
    sys.exit(0)
  if own[0] in COMMANDS and any(arg in usage.HELP_FLAGS for arg in own[1:]):
    print(usage.command_text(own[0], FLAGS_READ[COMMANDS[own[0]]]))
    sys.exit(0)


def run(argv: list[str] | None = None) -> None:
  """The `meshtrain` console script; `argv` (default sys.argv[1:]) starts with the command."""
  argv = sys.argv[1:] if argv is None else list(argv)
  _help(argv)
  if argv[0] not in COMMANDS:
    _fail(ConfigError("command", f"{argv[0]!r} is not a command; use meshtrain "
                      f"{{{'|'.join(COMMANDS)}}} [--flags] (`meshtrain help` lists them)"))
  _GIVEN_ARGV[:] = argv
  argv = flag_parsing.with_config(argv, meshtrain.config.__file__)
  app.run(_guarded(COMMANDS[argv[0]]), argv=[f"meshtrain {argv[0]}", *argv[1:]],
          flags_parser=_parse_flags)


if __name__ == "__main__":
  run()
