"""The tiny model on Shakespeare with a 1024-id BPE, one CPU device, a few minutes.

Prepare the corpus first (README, "Train on your own text"):

  meshtrain prepare --input ../shared/data/tinyshakespeare.txt --tokenizer train:1024 \
    --out runs/shakespeare
"""

from meshtrain import config


def get_config():
  c = config.get_config()
  c.workdir = "runs/shakespeare_bpe"
  c.data.source = "tokens"
  c.data.path = "runs/shakespeare"
  c.model.vocab_size = 1024     # the trained BPE's ids
  c.simulate_devices = 1
  c.steps = 500
  c.optimizer.warmup_steps = 50
  c.log_every = 25
  c.eval.every_steps = 100
  c.eval.batches = 8
  c.checkpoint.every_steps = 250
  return c
