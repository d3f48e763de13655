"""Where a run starts: its workdir's newest checkpoint, another run's, a
Hugging Face model's weights, or a fresh init."""

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp

from meshtrain.checkpoint import Checkpoints
from meshtrain.errors import ConfigError
from meshtrain.hf import importer
from meshtrain.hf.load import check_model, load_model_state, load_params
from meshtrain.parallel.pipeline.stages import StageLayout
from meshtrain.train.optimizer import schedule_change
from meshtrain.train.precision import initial_loss_scale
from meshtrain.train.relayout import Relayout, saved_layout
from meshtrain.train.setup import Setup
from meshtrain.train.state import TrainState


def _restore_source(path: str) -> tuple[Checkpoints, int]:
  """`config.checkpoint.restore_from`: a checkpoints directory (its newest step) or one step in it."""
  key, path = "config.checkpoint.restore_from", Path(path)
  directory, step = (path.parent, int(path.name)) if path.name.isdigit() else (path, None)
  if not directory.is_dir():
    found = "is a file" if path.is_file() else "does not exist"
    raise ConfigError(key, f"{path} {found}; give a run's checkpoints directory "
                      "(WORKDIR/checkpoints) or one step directory in it")
  source = Checkpoints(directory, read_only=True, config_key=key)
  step = source.latest_step() if step is None else step
  if step is None or not (directory / str(step)).is_dir():
    source.close()
    raise ConfigError(key, f"{path} holds no complete checkpoint")
  return source, step


def start_state(setup: Setup, batches) -> tuple[TrainState, Checkpoints, str]:
  """The state to start `setup`'s run from: the workdir's newest checkpoint,
  else the one `config.checkpoint.restore_from` names, else
  `config.init_from`'s weights or a fresh init. Everything is read and
  checked before anything is written. Returns the state, the workdir's
  checkpoints and where the state came from."""
  cfg, own, source, step = setup.cfg, None, None, None
  try:
    if (Path(cfg.workdir) / "checkpoints").is_dir():
      own = _own(cfg)
      source, step = own, own.latest_step()
    if step is None and cfg.checkpoint.restore_from:
      source, step = _restore_source(cfg.checkpoint.restore_from)
    if step is None and cfg.init_from:
      return init_from(setup), own or _own(cfg), f"initialized from {cfg.init_from}"
    if step is None:
      return setup.init_state(), own or _own(cfg), "initialized"
    if source is own and step >= cfg.steps:
      _check_same_run(own, step, cfg)
    if source is own and not cfg.checkpoint.allow_changes:
      _check_unchanged(own, step, cfg)
    relayout = Relayout(saved_layout(source.saved_config(step)), setup.run.layout)
    abstract, shardings = relayout.as_saved(setup.abstract_state(), setup.shardings)
    state = relayout.moved(source.restore(step, shardings, abstract, batches, cfg),
                           setup.shardings)
    note = schedule_change(own.saved_config(step), cfg, step) if source is own else None
    if note and jax.process_index() == 0:
      print(note, flush=True)
  except Exception:
    for checkpoints in {own, source} - {None}:
      checkpoints.close()
    raise
  if source is not own:
    source.close()
  if cfg.nan_policy == "stop":  # a stop's count would freeze the new run at once
    state = dataclasses.replace(state, nonfinite_steps=jnp.zeros_like(state.nonfinite_steps))
  return state, own or _own(cfg), f"resumed from {source.directory / str(step)}"


# What an exact resume needs unchanged: the data stream (order, batches, windows)
# and the model's definition. Optimizer settings may change (say, a lower
# learning rate after a non-finite stop), and so may how the model runs
# (`config.experts`, `config.attention`, the mesh, precision and recomputation).
RESUME_KEYS = ("seed", "global_batch", "seq_len", "data", "tokenizer", "model")


def resume_changes(saved: dict, cfg, keys=RESUME_KEYS) -> list[str]:
  """`key before -> after` for each setting under `keys` (top-level keys) that
  differs from the checkpoint's config; keys only one of the two has (the
  checkpoint predates them, or they have left `config.model` since) are not
  compared."""
  current = json.loads(json.dumps(cfg.to_dict()))  # as saved: tuples become lists
  before, after = (_flat({k: config[k] for k in keys if k in saved and k in current})
                   for config in (saved, current))
  return [f"{key} {before[key]!r} -> {after[key]!r}" for key in before
          if key in after and before[key] != after[key]]


# What a finished run may differ in from the config that finds it: the steps
# it ran to, where it lies (a copied workdir) and how its devices were set up.
SAME_RUN_IGNORES = ("steps", "workdir", "distributed", "simulate_devices")


def _check_same_run(own: Checkpoints, step: int, cfg) -> None:
  """A workdir already at `config.steps` holds nothing to do for its own
  config, and another config's finished run (two presets sharing one
  workdir) is an error rather than a silent exit 0."""
  saved = own.saved_config(step)
  changes = resume_changes(saved, cfg, [k for k in saved if k not in SAME_RUN_IGNORES])
  if changes:
    shown = ", ".join(changes[:6]) + (f" and {len(changes) - 6} more" if len(changes) > 6 else "")
    raise ConfigError("config.workdir", f"{own.directory.parent} holds a finished run (step "
                      f"{step}) of another config ({shown}); give this run its own "
                      "--config.workdir, or remove that directory to start over")


def _flat(tree: dict, prefix: str = "") -> dict:
  flat = {}
  for key, value in tree.items():
    flat.update(_flat(value, f"{prefix}{key}.") if isinstance(value, dict)
                else {f"{prefix}{key}": value})
  return flat


def _check_unchanged(own: Checkpoints, step: int, cfg) -> None:
  changes = resume_changes(own.saved_config(step), cfg)
  if changes:
    raise ConfigError("config.workdir", f"resuming {own.directory / str(step)}, which was saved "
                      f"with other settings that an exact resume needs: {', '.join(changes)}; "
                      "set them back, use a new config.workdir, or set "
                      "config.checkpoint.allow_changes=true")


def _own(cfg) -> Checkpoints:
  return Checkpoints(Path(cfg.workdir) / "checkpoints", keep=cfg.checkpoint.keep,
                     every_steps=cfg.checkpoint.every_steps,
                     config_key="config.workdir")


def initial_state(setup: Setup, directory, *, key: str) -> TrainState:
  """The train state at step 0 with the weights of the Hugging Face model in
  `directory`, each device reading only its shards (`key` names the flag)."""
  own = setup.run.layout  # the model's layers are one stack there
  relayout = Relayout(StageLayout((own.num_layers,), 1), own)
  params = relayout.moved(load_params(directory, *relayout.as_saved(
      setup.spec.abstract_params, setup.shardings.params), key=key), setup.shardings.params)
  abstract_state = jax.eval_shape(setup.spec.init_model_state)
  model_state = load_model_state(directory, *relayout.as_saved(
      abstract_state, setup.shardings.model_state), key=key)
  if model_state is not None:
    model_state = relayout.moved(model_state, setup.shardings.model_state)

  def create(params, model_state):
    return TrainState(jnp.zeros((), jnp.int32), params, setup.optimizer.init(params),
                      jnp.zeros((), jnp.int32), loss_scale=initial_loss_scale(setup.cfg),
                      model_state=(setup.spec.init_model_state() if model_state is None
                                   else model_state))
  with jax.set_mesh(setup.mesh):
    return jax.jit(create, out_shardings=setup.shardings, donate_argnums=0)(params, model_state)


def init_from(setup: Setup) -> TrainState:
  """The start of a run with `config.init_from=hf:DIR`; its `config.model` must be DIR's model."""
  cfg, key = setup.cfg, "config.init_from"
  if not cfg.init_from.startswith(importer.PREFIX):
    raise ConfigError(key, f"{cfg.init_from!r} is not '' or 'hf:DIR' (a Hugging Face model "
                      "directory)")
  directory = cfg.init_from[len(importer.PREFIX):]
  check_model(directory, cfg.model, key=key)
  note = importer.balancing_note(Path(directory), cfg.model.moe)
  if note and jax.process_index() == 0:
    print(note, flush=True)
  return initial_state(setup, directory, key=key)
