"""The optimizer of `config.optimizer` (optax), with linear warmup, cosine decay
and global-norm clipping: AdamW (default), SGD, Lion or Adafactor."""

import jax
import ml_collections
import optax

from meshtrain.errors import ConfigError

NO_DECAY = ("scale", "bias")  # norm scales and biases keep their size
OPTIMIZERS = ("adamw", "sgd", "lion", "adafactor")


def learning_rate_schedule(opt_cfg, total_steps: int) -> optax.Schedule:
  warmup = min(opt_cfg.warmup_steps, max(total_steps - 1, 0))
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=opt_cfg.learning_rate, warmup_steps=warmup,
      decay_steps=max(total_steps, warmup + 1),
      end_value=opt_cfg.learning_rate * opt_cfg.min_lr_ratio)


SCHEDULE_KEYS = ("learning_rate", "warmup_steps", "min_lr_ratio")


def schedule_change(saved: dict, cfg, done: int) -> str | None:
  """What a resume after step `done` does to the learning rate when `steps` or
  the schedule's keys differ from the checkpoint's config `saved`: the
  schedule is rebuilt for the new values (a longer run stretches the warmup
  and cosine decay, so the rate jumps), and the note says by how much."""
  old_opt = ml_collections.ConfigDict(saved.get("optimizer", {}))
  changes = [f"steps {saved['steps']} -> {cfg.steps}"] if saved.get("steps") != cfg.steps else []
  changes += [f"optimizer.{key} {old_opt[key]} -> {cfg.optimizer[key]}" for key in SCHEDULE_KEYS
              if key in old_opt and old_opt[key] != cfg.optimizer[key]]
  if not changes or "steps" not in saved or any(k not in old_opt for k in SCHEDULE_KEYS):
    return None
  old = learning_rate_schedule(old_opt, saved["steps"])
  new = learning_rate_schedule(cfg.optimizer, cfg.steps)
  return (f"note: {', '.join(changes)}: the learning-rate schedule (warmup, then cosine decay to "
          f"the end) is now the one of {cfg.steps} steps: step {done + 1} runs at "
          f"{float(new(done)):.3g} where the checkpoint's schedule gives {float(old(done)):.3g} "
          f"(step {done} ran at {float(old(max(done - 1, 0))):.3g})")


def decay_mask(params):
  """True for weights that get weight decay: every leaf not named in NO_DECAY."""
  def decays(path, _):
    return not any(getattr(key, "key", None) in NO_DECAY for key in path)
  return jax.tree_util.tree_map_with_path(decays, params)


def base_optimizer(opt_cfg, learning_rate: optax.ScalarOrSchedule) -> optax.GradientTransformation:
  """`config.optimizer.name` with its hyperparameters, no clipping. Weight decay
  is decoupled (AdamW, Lion, Adafactor) or added to the gradient (SGD, as in
  PyTorch), and skips NO_DECAY leaves."""
  name, wd = opt_cfg.name, opt_cfg.weight_decay
  if name == "adamw":
    return optax.adamw(learning_rate, b1=opt_cfg.b1, b2=opt_cfg.b2, eps=opt_cfg.eps,
                       weight_decay=wd, mask=decay_mask)
  if name == "sgd":
    sgd = optax.sgd(learning_rate, momentum=opt_cfg.momentum or None)
    return optax.chain(optax.add_decayed_weights(wd, decay_mask), sgd) if wd else sgd
  if name == "lion":
    return optax.lion(learning_rate, b1=opt_cfg.b1, b2=opt_cfg.b2, weight_decay=wd,
                      mask=decay_mask)
  if name == "adafactor":
    return optax.adafactor(learning_rate, weight_decay_rate=wd or None,
                           weight_decay_mask=decay_mask)
  raise ConfigError("config.optimizer.name",
                    f"{name!r} is not one of {', '.join(map(repr, OPTIMIZERS))}")


def make_optimizer(opt_cfg, total_steps: int) -> optax.GradientTransformation:
  optimizer = base_optimizer(opt_cfg, learning_rate_schedule(opt_cfg, total_steps))
  if opt_cfg.clip_norm > 0:
    return optax.chain(optax.clip_by_global_norm(opt_cfg.clip_norm), optimizer)
  return optimizer
