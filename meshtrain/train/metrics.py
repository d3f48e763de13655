"""Where logged metrics go: `metrics.jsonl` and TensorBoard, from process 0 only."""

import json
import math
from pathlib import Path

import jax
from tensorboardX import SummaryWriter


class MetricsWriter:
  """Appends to `metrics.jsonl`; a resumed run first drops the records after its checkpoint."""

  def __init__(self, workdir: Path, resumed_step: int = 0):
    self.enabled = jax.process_index() == 0
    if self.enabled:
      path = workdir / "metrics.jsonl"
      kept = _records_up_to(path, resumed_step) if resumed_step and path.exists() else []
      path.write_text("".join(line + "\n" for line in kept))
      self._jsonl = open(path, "a")
      self._tensorboard = SummaryWriter(str(workdir / "tensorboard"))

  def write(self, record: dict) -> None:
    if not self.enabled:
      return
    self._jsonl.write(json.dumps(record) + "\n")
    self._jsonl.flush()
    for key, value in record.items():
      if key != "step" and isinstance(value, (int, float)) and math.isfinite(value):
        self._tensorboard.add_scalar(key, value, record["step"])

  def close(self) -> None:
    if self.enabled:
      self._jsonl.close()
      self._tensorboard.close()


def _records_up_to(path: Path, step: int) -> list[str]:
  """The lines of `path` up to `step`; a line cut short by a kill mid-write is dropped."""
  kept = []
  for line in path.read_text(errors="replace").splitlines():
    try:
      record = json.loads(line)
    except json.JSONDecodeError:
      continue
    if isinstance(record, dict) and isinstance(record.get("step"), int) and record["step"] <= step:
      kept.append(line)
  return kept
