"""The small run the training-quality benchmarks compare settings on: a
0.1M-parameter Llama on the shakespeare text, 32 x 64 tokens a step, on 8
simulated CPU devices (a run is minutes on a shared 2-core CPU), and the
figures they read off its records."""

from pathlib import Path

import numpy as np

from meshtrain.config import get_config

SHAKESPEARE = Path(__file__).resolve().parents[2] / "shared" / "data" / "tinyshakespeare.txt"
WINDOW = 20  # steps averaged for the final loss


def config(steps: int, workdir: str, mesh: dict, changes: dict):
  """The run's config on `mesh` (axis sizes), with `changes` ("key" or
  "section.key": value) over it; no checkpoints."""
  cfg = get_config()
  cfg.update(steps=steps, workdir=workdir, global_batch=32, seq_len=64, log_every=1)
  cfg.model.update(embed_dim=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                   mlp_dim=192)
  cfg.mesh.update({"data": 1, **mesh})
  cfg.data.update(source="text", path=str(SHAKESPEARE))
  cfg.checkpoint.every_steps = 0
  for key, value in changes.items():
    *section, name = key.split(".")
    (cfg[section[0]] if section else cfg)[name] = value
  return cfg


def final_loss(losses: list[float]) -> float:
  return float(np.mean(losses[-WINDOW:]))


def smoothed(losses: list[float]) -> np.ndarray:
  """The losses' running mean over WINDOW steps, from step WINDOW on."""
  return np.convolve(losses, np.ones(WINDOW) / WINDOW, mode="valid")
