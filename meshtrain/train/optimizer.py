"""The optimizer of `config.optimizer` (optax), with linear warmup, cosine decay
and global-norm clipping: AdamW (default), SGD, Lion or Adafactor."""

import jax
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
