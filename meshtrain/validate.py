"""One check of the whole config, run by every command before anything is created.

Three layers, each a table that a new key extends with one entry:

- the key tree: every key must be one of `meshtrain.config.get_config()`'s
  (a typo gets "did you mean" over the whole tree) with the type of its default;
- `RULES`: the range or choices of one key's value;
- `IGNORED`: a key set away from its default while another key's value makes
  it do nothing, which is an error rather than a silent no-op.

`check_devices` then runs the cross-key checks that the deep code makes again
later (mesh x model x strategy x schedule x attention), by calling those same
check functions on an abstract mesh, so the message is the one the deep check
would give, only before anything is compiled or written.
"""

import difflib
import json
import math
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from jax.sharding import AbstractMesh, AxisType

import meshtrain.config
from meshtrain import distributed, rules
from meshtrain.data import SOURCES, tokenizer as tokenizers
from meshtrain.errors import ConfigError
from meshtrain.mesh import AXES, axis_sizes, host_split
from meshtrain.models import moe, rope
from meshtrain.parallel import float8, sequence
from meshtrain.parallel.pipeline import schedule as schedules
from meshtrain.train import local_sgd, mesh_checks, optimizer, precision
from meshtrain.train.run import resolve

Rule = Callable[[Any], str | None]  # a value -> what is wrong with it, or None


def at_least(low) -> Rule:
  return lambda value: None if value >= low else f"is {value!r}; use {low} or more"


def above(low) -> Rule:
  return lambda value: None if value > low else f"is {value!r}; use a value above {low}"


def within(low, high, *, high_open: bool = False) -> Rule:
  top = ")" if high_open else "]"
  def rule(value):
    inside = low <= value < high if high_open else low <= value <= high
    return None if inside else f"is {value!r}; use a value in [{low}, {high}{top}"
  return rule


def one_of(choices) -> Rule:
  return lambda value: (None if value in choices else
                        f"{value!r} is not one of {', '.join(map(repr, choices))}")


def not_empty(value) -> str | None:
  return None if str(value).strip() else "is empty; give a value"


# The most simulated CPU devices of one process: XLA's CPU backend compiles over
# at most 2048 (jax 0.10: 2049 fail with "Multiprocess computations aren't
# implemented"), and making tens of thousands takes minutes and gigabytes.
MAX_SIMULATED_DEVICES = 2048

RULES: dict[str, Rule] = {
    "seed": within(0, 2**32 - 1),
    "workdir": not_empty,
    "steps": within(1, 2**31 - 1),  # the step counter is int32
    "global_batch": at_least(1),
    "seq_len": within(1, 2**31 - 1),  # positions are int32
    "grad_accum_steps": at_least(1),
    "param_dtype": one_of(mesh_checks.DTYPES),
    "compute_dtype": one_of(mesh_checks.DTYPES),
    "float8": one_of(float8.CHOICES),
    "remat": one_of(mesh_checks.REMAT),
    "zero_stage": one_of(rules.ZERO_STAGES),
    "simulate_devices": within(0, MAX_SIMULATED_DEVICES),
    "peak_flops": at_least(0),
    "log_every": at_least(1),
    "nan_policy": one_of(mesh_checks.NAN_POLICIES),
    **{f"model.{name}": at_least(1) for name in (
        "vocab_size", "embed_dim", "num_layers", "num_heads", "num_kv_heads", "head_dim",
        "mlp_dim")},
    "model.sliding_window": at_least(0),
    "model.rope_theta": above(0),
    **{f"model.rope_{name}": above(0) for name in (
        "scaling_factor", "low_freq_factor", "high_freq_factor")},
    "model.rope_original_max_positions": at_least(1),
    "model.rope_scaling_type": one_of(rope.SCALINGS),
    **{f"model.rope_{name}": above(0) for name in ("beta_fast", "beta_slow")},
    **{f"model.rope_{name}": at_least(0) for name in (
        "attention_factor", "mscale", "mscale_all_dim")},
    "model.norm_eps": above(0),
    "model.mtp_layers": at_least(0),
    "model.mtp_loss_coef": at_least(0),
    **{f"model.moe.{name}": at_least(0) for name in (
        "num_experts", "mlp_dim", "shared_mlp_dim", "first_dense_layers", "aux_loss_coef",
        "bias_update_rate", "capacity_factor")},
    **{f"model.mla.{name}": at_least(0) for name in ("kv_lora_rank", "q_lora_rank")},
    **{f"model.mla.{name}": at_least(1) for name in ("rope_head_dim", "v_head_dim")},
    "model.moe.experts_per_token": at_least(1),
    "model.moe.expert_groups": at_least(1),
    "model.moe.groups_per_token": at_least(0),
    "model.moe.group_scored_by": at_least(1),
    "model.moe.router": one_of(moe.ROUTERS),
    "model.moe.route_scale": above(0),
    "attention.sequence_strategy": one_of(sequence.STRATEGIES),
    "attention.implementation": one_of(mesh_checks.ATTENTION),
    "pipeline.schedule": one_of(schedules.SCHEDULE_NAMES),
    "pipeline.microbatches": at_least(1),
    "pipeline.virtual_stages": at_least(1),
    "optimizer.name": one_of(optimizer.OPTIMIZERS),
    "optimizer.learning_rate": above(0),
    "optimizer.warmup_steps": at_least(0),
    "optimizer.min_lr_ratio": within(0, 1),
    "optimizer.b1": within(0, 1, high_open=True),
    "optimizer.b2": within(0, 1, high_open=True),
    "optimizer.eps": above(0),
    "optimizer.weight_decay": at_least(0),
    "optimizer.clip_norm": at_least(0),
    "optimizer.momentum": within(0, 1, high_open=True),
    "local_sgd.inner_steps": at_least(0),
    "local_sgd.outer_optimizer": one_of(local_sgd.OUTER_OPTIMIZERS),
    "local_sgd.outer_learning_rate": above(0),
    "local_sgd.outer_momentum": within(0, 1, high_open=True),
    "loss_scale.initial": above(0),
    "loss_scale.period": at_least(1),
    "checkpoint.every_steps": at_least(0),
    "checkpoint.keep": at_least(0),
    "eval.every_steps": at_least(0),
    "eval.batches": at_least(1),
    "data.source": one_of(SOURCES),
    "distributed.step_timeout_s": at_least(0),
    "distributed.compile_timeout_s": at_least(0),
    "distributed.save_timeout_s": at_least(0),
}

# key -> (does another key's value make it do nothing?, why, and the fix).
# `sizes` are the resolved mesh axis sizes; None before the device count is known.
Ignored = Callable[[Any, Mapping[str, int] | None], bool]
IGNORED: dict[str, tuple[Ignored, str]] = {
    "data.path": (lambda c, sizes: c.data.source == "synthetic",
                  "data.source=synthetic reads no file; set config.data.source=text"),
    "distributed.process_id": (lambda c, sizes: c.distributed.num_processes in (0, 1),
                               "it is used only with distributed.num_processes > 1"),
    "distributed.coordinator_address": (lambda c, sizes: c.distributed.num_processes in (0, 1),
                                        "it is used only with distributed.num_processes > 1"),
    **{f"distributed.{name}": (lambda c, sizes: c.distributed.num_processes == 1,
                               "a job of one process has no peers to wait for; it is used only "
                               "with distributed.num_processes > 1 (or 0)")
       for name in ("step_timeout_s", "compile_timeout_s", "save_timeout_s")},
    "attention.sequence_strategy": (lambda c, sizes: sizes and sizes["sequence"] == 1,
                                    "mesh.sequence is 1, so no sequence strategy runs; "
                                    "set config.mesh.sequence > 1"),
    "tensor_sequence_parallel": (lambda c, sizes: sizes and sizes["tensor"] == 1,
                                 "mesh.tensor is 1, so nothing is split; set config.mesh.tensor > 1"),
    "grad_dtype": (lambda c, sizes: sizes and sizes["pipeline"] > 1,
                   "the pipeline accumulates its microbatches' gradients in float32; "
                   "set config.grad_dtype=float32"),
    **{f"pipeline.{name}": (lambda c, sizes: sizes and sizes["pipeline"] == 1,
                            "mesh.pipeline is 1, so no pipeline runs; set config.mesh.pipeline > 1")
       for name in ("schedule", "microbatches", "virtual_stages", "stage_layers")},
    "optimizer.momentum": (lambda c, sizes: c.optimizer.name != "sgd",
                           "only optimizer.name=sgd has momentum; set config.optimizer.name=sgd"),
    **{f"local_sgd.{name}": (lambda c, sizes: not c.local_sgd.inner_steps,
                             "local_sgd.inner_steps is 0, so replicas never sync; set it > 0")
       for name in ("outer_optimizer", "outer_learning_rate", "outer_momentum")},
    **{f"loss_scale.{name}": (lambda c, sizes: not precision.uses_loss_scale(c),
                              "only float16 training scales its loss; set "
                              "config.param_dtype or config.compute_dtype=float16")
       for name in ("initial", "period")},
    **{f"model.rope_{name}": (lambda c, sizes: c.model.rope_scaling_factor == 1,
                              "model.rope_scaling_factor is 1, so RoPE is not scaled; set it "
                              "to the model's context factor")
       for name in ("original_max_positions", "scaling_type")},
    **{f"model.rope_{name}": (lambda c, sizes: c.model.rope_scaling_factor == 1
                              or c.model.rope_scaling_type != "llama3",
                              "only llama3 RoPE scaling has it; set "
                              "config.model.rope_scaling_type=llama3 and rope_scaling_factor")
       for name in ("low_freq_factor", "high_freq_factor")},
    **{f"model.rope_{name}": (lambda c, sizes: c.model.rope_scaling_factor == 1
                              or c.model.rope_scaling_type != "yarn",
                              "only yarn RoPE scaling has it; set "
                              "config.model.rope_scaling_type=yarn and rope_scaling_factor")
       for name in ("beta_fast", "beta_slow", "attention_factor", "mscale", "mscale_all_dim",
                    "truncate")},
    **{key: (lambda c, sizes: not c.model.moe.num_experts,
             "model.moe.num_experts is 0, so the model has no experts; set it > 0")
       for key in ["expert_parallel",
                   *(f"experts.{name}" for name in meshtrain.config.get_config().experts),
                   *(f"model.moe.{name}" for name in moe.MoEConfig.__annotations__
                     if name != "num_experts")]},
    "model.mtp_loss_coef": (lambda c, sizes: not c.model.mtp_layers,
                            "model.mtp_layers is 0, so there is no multi-token prediction loss; "
                            "set config.model.mtp_layers > 0"),
    **{f"model.mla.{name}": (lambda c, sizes: not c.model.mla.kv_lora_rank,
                             "model.mla.kv_lora_rank is 0, so the attention is grouped-query, "
                             "not latent; set it > 0")
       for name in ("q_lora_rank", "rope_head_dim", "v_head_dim", "rope_interleave")},
    "model.moe.expert_groups": (lambda c, sizes: not (c.model.moe.num_experts
                                                      and c.model.moe.groups_per_token),
                                "a token chooses among every group's experts unless "
                                "model.moe.groups_per_token > 0 (in a model with experts); "
                                "set config.model.moe.groups_per_token"),
    "model.moe.groups_per_token": (lambda c, sizes: not c.model.moe.num_experts
                                   or c.model.moe.expert_groups == 1,
                                   "model.moe.expert_groups is 1, so there are no groups to "
                                   "choose from; set config.model.moe.expert_groups > 1"),
    "model.moe.group_scored_by": (lambda c, sizes: not c.model.moe.groups_per_token,
                                  "model.moe.groups_per_token is 0, so no group is scored; "
                                  "set config.model.moe.groups_per_token > 0"),
    "model.moe.shared_gate": (lambda c, sizes: not (c.model.moe.num_experts
                                                    and c.model.moe.shared_mlp_dim),
                              "the model has no shared expert to gate; set "
                              "config.model.moe.num_experts and model.moe.shared_mlp_dim > 0"),
}


def _leaves(tree, prefix: str = "") -> dict[str, Any]:
  """Dotted key -> value for every leaf of a ConfigDict (or dict) tree."""
  leaves = {}
  for key, value in tree.items():
    if isinstance(value, Mapping) or hasattr(value, "items"):
      leaves.update(_leaves(value, f"{prefix}{key}."))
    else:
      leaves[f"{prefix}{key}"] = value
  return leaves


def unknown_key(key: str, known) -> ConfigError:
  """`key` is not a config key: the error, with where it has moved or the
  closest known keys."""
  if key in meshtrain.config.MOVED:
    return ConfigError(f"config.{key}", f"has moved to config.{meshtrain.config.MOVED[key]} "
                       "(how the model runs, apart from what it is)")
  close = difflib.get_close_matches(key, list(known), n=1, cutoff=0.6) or difflib.get_close_matches(
      key.rpartition(".")[2], [k.rpartition(".")[2] for k in known], n=1, cutoff=0.6)
  if close and "." not in close[0]:  # matched on the last part: name the full key
    close = [k for k in known if k.rpartition(".")[2] == close[0]][:1]
  hint = f"; did you mean config.{close[0]}?" if close else "; see meshtrain/config.py for every key"
  return ConfigError(f"config.{key}", f"is not a config key{hint}")


def _type_problem(value, default) -> str | None:
  if isinstance(default, bool):
    ok, wanted = isinstance(value, bool), "true or false"
  elif isinstance(default, int):
    ok, wanted = isinstance(value, int) and not isinstance(value, bool), "an integer"
  elif isinstance(default, float):
    ok, wanted = isinstance(value, int | float) and not isinstance(value, bool), "a number"
  elif isinstance(default, str):
    ok, wanted = isinstance(value, str), "a string"
  else:
    return None
  if not ok:
    return f"is {value!r} ({type(value).__name__}); give {wanted}"
  if isinstance(value, float) and not math.isfinite(value):
    return f"is {value!r}; give a finite number"
  return None


def check_config(cfg) -> None:
  """`check_values`, then the files the config names (its tokenizer, its text
  data): everything that needs no device."""
  check_values(cfg)
  if cfg.tokenizer:  # used by samples and exports, after the run: load it now
    tokenizers.load(cfg.tokenizer, key="config.tokenizer")
  if cfg.data.source == "text" and cfg.data.path and not Path(cfg.data.path).is_file():
    found = "is a folder" if Path(cfg.data.path).is_dir() else "not found"
    raise ConfigError("config.data.path", f"file '{cfg.data.path}' {found}; point "
                      "config.data.path at a UTF-8 text file")


def check_values(cfg) -> None:
  """Keys, types, ranges, keys made idle by others and the job's settings: what
  `check_config` checks without reading a file, and all that a change of
  values alone (an import's model) needs checked again."""
  defaults = config_keys()
  values = _leaves(cfg)
  for key in values:
    if key not in defaults:
      raise unknown_key(key, defaults)
  for key in defaults:
    if key not in values:
      raise ConfigError(f"config.{key}", "is missing; start a config file from "
                        "meshtrain.config.get_config() (or a preset in configs/)")
  for key, value in values.items():
    problem = _type_problem(value, defaults[key]) or (RULES[key](value) if key in RULES else None)
    if problem:
      raise ConfigError(f"config.{key}", problem)
  _check_ignored(cfg, values, defaults, sizes=None)
  _check_rope_scaling(cfg.model)
  _check_mtp_layers(cfg)
  distributed.check(cfg.distributed)


def _check_mtp_layers(cfg) -> None:
  """Module k of the multi-token prediction predicts the token k + 1 places
  ahead: a sequence has one for k < seq_len only."""
  if cfg.model.mtp_layers >= cfg.seq_len:
    raise ConfigError("config.model.mtp_layers", f"is {cfg.model.mtp_layers}, but module k "
                      f"predicts the token k + 1 places ahead, which sequences of "
                      f"config.seq_len={cfg.seq_len} tokens hold only for k < {cfg.seq_len}; "
                      f"set it below {cfg.seq_len} (DeepSeek-V3 trains 1)")


def _check_rope_scaling(model) -> None:
  """RoPE scaling interpolates between two bounds: llama3's wavelengths, yarn's turns."""
  if model.rope_scaling_factor == 1:
    return
  if model.rope_scaling_type == "llama3" and (model.rope_high_freq_factor
                                              <= model.rope_low_freq_factor):
    raise ConfigError("config.model.rope_high_freq_factor", f"is {model.rope_high_freq_factor}, "
                      f"not above rope_low_freq_factor={model.rope_low_freq_factor}; Llama 3 "
                      "uses 4 and 1")
  if model.rope_scaling_type == "yarn" and model.rope_beta_fast <= model.rope_beta_slow:
    raise ConfigError("config.model.rope_beta_fast", f"is {model.rope_beta_fast}, not above "
                      f"rope_beta_slow={model.rope_beta_slow}; YaRN uses 32 and 1")


def _check_ignored(cfg, values, defaults, sizes) -> None:
  for key, (idle, why) in IGNORED.items():
    if key in values and values[key] != defaults[key] and idle(cfg, sizes):
      raise ConfigError(f"config.{key}", f"is set to {values[key]!r} but ignored: {why}")


def check_devices(cfg, num_devices: int, platform: str | None = None) -> None:
  """The cross-key checks for `num_devices` devices: the keys `IGNORED` on
  that mesh, the hosts' split, then the run's resolution on an abstract mesh
  of its sizes (`meshtrain.train.run.resolve`: every check of the config
  against the mesh); with `platform` (the devices the run will use), first
  whether cuDNN's attention runs on them."""
  sizes = axis_sizes(cfg.mesh, num_devices)
  _check_ignored(cfg, _leaves(cfg), config_keys(), sizes)
  across = [a.strip() for a in cfg.mesh.across_hosts.split(",") if a.strip()]
  host_split(sizes, across, max(cfg.distributed.num_processes, 1))
  if cfg.attention.implementation == "cudnn" and platform not in (None, "gpu"):
    raise ConfigError("config.attention.implementation", f"cudnn runs on NVIDIA GPUs, not on "
                      f"these {platform} devices; use xla (or \"\" for the best available)")
  mesh = AbstractMesh(tuple(sizes[a] for a in AXES), AXES, axis_types=(AxisType.Auto,) * len(AXES))
  resolve(cfg, mesh)  # every check of the run's resolution that needs no devices


def check_workdir(cfg) -> None:
  """The workdir can be created and written: the nearest existing folder on its
  path is a writable folder (a file there, or a read-only filesystem, is not)."""
  workdir = Path(cfg.workdir).absolute()
  existing = next(p for p in (workdir, *workdir.parents) if p.exists())
  if not existing.is_dir():
    raise ConfigError("config.workdir", f"{existing} is a file, not a folder; choose another "
                      "config.workdir")
  if not os.access(existing, os.W_OK | os.X_OK):
    raise ConfigError("config.workdir", f"{existing} is not writable (read-only filesystem or "
                      "no permission); choose a writable config.workdir")
  if (workdir / "checkpoints").exists() and not (workdir / "checkpoints").is_dir():
    raise ConfigError("config.workdir", f"{workdir / 'checkpoints'} is a file, not the "
                      "checkpoints folder; move it away or choose another config.workdir")
  saved = workdir / "config.json"
  if saved.is_file() and not _is_run_config(saved):  # a run writes its own over it
    raise ConfigError("config.workdir", f"{saved} is not a meshtrain run's config (a Hugging "
                      "Face model's?); choose a new config.workdir, or `meshtrain import-hf` "
                      "the model into one")


def _is_run_config(path: Path) -> bool:
  try:
    saved = json.loads(path.read_text())
  except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError):
    return False
  return isinstance(saved, dict) and {"mesh", "model", "optimizer"} <= saved.keys()


def check(cfg, num_devices: int | None = None, platform: str | None = None) -> None:
  """`check_config`, then `check_devices` when the device count is known."""
  check_config(cfg)
  if num_devices is not None:
    check_devices(cfg, num_devices, platform)


def config_keys() -> dict[str, Any]:
  """Every config key (dotted) with its default."""
  return _leaves(meshtrain.config.get_config())
