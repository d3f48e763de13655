"""Llama 3.2 3B shape (3.21B parameters, tied embeddings): the 1B preset wider
and deeper, and the largest preset whose float32 master weights and AdamW state
(51 GB) fit one 80 GB GPU."""

from pathlib import Path

from meshtrain.config import load


def get_config():
  c = load(Path(__file__).with_name("llama_1b.py"))
  c.model.update(embed_dim=3072, num_layers=28, num_heads=24, head_dim=128)
  c.remat = "full"
  return c
