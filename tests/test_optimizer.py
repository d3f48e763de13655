"""`config.optimizer.name`: each optimizer, sharded, equals the same optax
optimizer written out here, run unsharded under plain `jax.jit`."""

import optax
import pytest

from conftest import micro_config, tiered
from reference import random_batches
from equivalence import assert_matches_one_device
from meshtrain.errors import ConfigError
from meshtrain.train.optimizer import decay_mask, learning_rate_schedule
from meshtrain.train.setup import build


def optax_reference(opt_cfg, steps):
  """The optimizer each name means, spelled out from optax (clipping on)."""
  lr = learning_rate_schedule(opt_cfg, steps)
  optimizer = {
      "sgd": lambda: optax.chain(optax.add_decayed_weights(opt_cfg.weight_decay, decay_mask),
                                 optax.sgd(lr, momentum=0.9)),
      "lion": lambda: optax.lion(lr, b1=0.9, b2=0.99, weight_decay=opt_cfg.weight_decay,
                                 mask=decay_mask),
      "adafactor": lambda: optax.adafactor(lr, weight_decay_rate=opt_cfg.weight_decay,
                                           weight_decay_mask=decay_mask),
  }[opt_cfg.name]()
  return optax.chain(optax.clip_by_global_norm(opt_cfg.clip_norm), optimizer)


@pytest.mark.parametrize("name", tiered(["sgd", "lion", "adafactor"], ("adafactor",)))
def test_optimizer_matches_plain_optax(name):
  # fsdp=8 shards the optimizer state; embed_dim 128 makes Adafactor factor its
  # second moments (rows and columns, shaped unlike the weights).
  cfg = micro_config(**{"mesh.data": 1, "mesh.fsdp": 8, "optimizer.name": name,
                        "optimizer.momentum": 0.9, "optimizer.b2": 0.99,
                        "optimizer.learning_rate": 0.1 if name == "sgd" else 3e-3,
                        "model.embed_dim": 128 if name == "adafactor" else 32,
                        "model.mlp_dim": 128 if name == "adafactor" else 64})
  batches = random_batches(4, cfg.global_batch, cfg.seq_len, cfg.model.vocab_size)
  _, losses, _ = assert_matches_one_device(cfg, batches, optax_reference(cfg.optimizer, cfg.steps))
  assert losses[-1] < losses[0]


def test_unknown_optimizer_names_the_key():
  with pytest.raises(ConfigError, match="config.optimizer.name: 'adam' is not one of"):
    build(micro_config(**{"optimizer.name": "adam"}))
