"""A run's workdir read back (export-hf, generate): its config and the weights
of one checkpoint; and the new or empty directory a command writes into."""

import json
from pathlib import Path

import jax
import ml_collections
import orbax.checkpoint as ocp

from meshtrain.checkpoint import damage_reason
from meshtrain.config import from_saved
from meshtrain.errors import ConfigError, reading


def check_new_directory(directory, key: str, holds: str | None = None) -> None:
  """Refuses `directory` unless it is new or empty: what a command writes
  (config.json, tokenizer.json, ...) would overwrite files of the same names.
  `holds` names what the caller recognized in it (a run, a model)."""
  directory = Path(directory)
  if not directory.exists():
    return
  problem = ("is a file" if not directory.is_dir() else f"already holds {holds}" if holds
             else "is not empty" if any(directory.iterdir()) else None)
  if problem:
    raise ConfigError(key, f"{directory} {problem}; give a new or empty directory")


def load_config(workdir, overrides: dict) -> ml_collections.ConfigDict:
  """The config `workdir` was written with (keys it predates at their defaults),
  with `overrides` ({"mesh.tensor": 2, ...}, from --config.* flags) applied."""
  file = Path(workdir) / "config.json"
  if not file.is_file():
    raise ConfigError("--workdir", f"{workdir} has no config.json; give a workdir that "
                      "`meshtrain train` or `meshtrain import-hf` wrote")
  with reading("--workdir", file):
    text = file.read_bytes()
  try:
    saved = json.loads(text)
    if not isinstance(saved, dict):
      raise ValueError(f"a JSON {type(saved).__name__}, not an object")
    # How the run was launched belongs to that launch: a command that reads the
    # run joins a job only when its own flags say so, on as many devices in all.
    launched = saved.pop("distributed", {})
    if saved.get("simulate_devices") and launched.get("num_processes", 1) > 1:
      saved["simulate_devices"] *= launched["num_processes"]
    cfg = from_saved(saved)
  except (ValueError, TypeError, AttributeError, RecursionError) as error:
    raise ConfigError("--workdir", f"{file} is not a run's config ({_first_line(error)}); give "
                      "the workdir that `meshtrain train` or `meshtrain import-hf` wrote, its "
                      "config.json as written") from None
  for key, value in overrides.items():
    section, _, name = key.rpartition(".")
    (cfg[section] if section else cfg)[name] = value
  return cfg


def _first_line(error: Exception) -> str:
  return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__


def checkpoint_step(workdir, step: int | None) -> int:
  """`step` if the workdir holds it, else (None) its newest checkpoint."""
  directory = Path(workdir) / "checkpoints"
  steps = sorted(int(p.name) for p in directory.glob("*") if p.name.isdigit()) if directory.is_dir() else []
  if not steps:
    raise ConfigError("--workdir", f"{workdir} holds no checkpoint (no {directory}/STEP)")
  if step is None:
    return steps[-1]
  if step not in steps:
    raise ConfigError("--step", f"{workdir} has no checkpoint of step {step}; it has {steps}")
  return step


def load_params(workdir, step: int, abstract_params, shardings):
  """The float32 master weights of checkpoint `step`, read straight into
  `shardings` (whatever mesh wrote them); the optimizer state is not read."""
  return _load_part(workdir, step, "params", abstract_params, shardings)


def load_model_state(workdir, step: int, abstract_state, shardings):
  """The model state (MoE router biases) of checkpoint `step`, or None for a
  model without one."""
  if not jax.tree.leaves(abstract_state):
    return None
  return _load_part(workdir, step, "model_state", abstract_state, shardings)


def _load_part(workdir, step: int, part: str, abstract, shardings):
  target = {part: jax.tree.map(
      lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), abstract, shardings)}
  path = Path(workdir).absolute() / "checkpoints" / str(step) / "state"
  try:
    with ocp.PyTreeCheckpointer() as checkpointer:
      restored = checkpointer.restore(path, args=ocp.args.PyTreeRestore(
          item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target),
          partial_restore=True))
  except Exception as error:
    where = f"checkpoint {step} in {workdir}"
    if (misfit := _misfit(error)) is not None:
      raise ConfigError("--workdir", f"{where} cannot be read into this config's model "
                        f"({misfit})") from None
    if (damage := damage_reason(error)) is not None:
      raise ConfigError("--workdir", f"{where} cannot be read ({damage}); its files are missing "
                        "or damaged: give another --step") from None
    if isinstance(error, OSError):
      raise ConfigError("--workdir", f"reading {where} failed ({error.strerror or error})"
                        ) from None
    raise  # not the checkpoint's files nor their fit: out of memory, a bug
  return restored[part]


def _misfit(error: Exception) -> str | None:
  """orbax's words for arrays that do not fit this config's model."""
  text = str(error).strip()
  if ((isinstance(error, ValueError) and "is not compatible with the stored shape" in text) or
      (isinstance(error, TypeError) and text.startswith("Type mismatch at key path"))):
    return text.splitlines()[0].split(". Truncating")[0]
  return None
