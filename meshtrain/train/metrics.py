"""Where logged metrics go: `metrics.jsonl` and TensorBoard, from process 0 only."""

import json
import math
import time
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


def records(path: Path) -> list[tuple[str, dict]]:
  """(line, record) for each record of a `metrics.jsonl`; a line cut short by
  a kill mid-write is dropped."""
  kept = []
  for line in path.read_text(errors="replace").splitlines():
    try:
      record = json.loads(line)
    except json.JSONDecodeError:
      continue
    if isinstance(record, dict) and isinstance(record.get("step"), int):
      kept.append((line, record))
  return kept


def _records_up_to(path: Path, step: int) -> list[str]:
  """The lines of `path` up to `step` (`records`)."""
  return [line for line, record in records(path) if record["step"] <= step]


class Throughput:
  """Step time, tokens/s and MFU since the last record; a run's first record
  holds its compilation instead (`compile_time_s`)."""

  def __init__(self, first_step: int, tokens_per_step: int, flops_per_token: float,
               peak_flops: float):
    self.tokens_per_step, self.flops_per_token, self.peak = (tokens_per_step, flops_per_token,
                                                             peak_flops)
    self.first, self.last_step, self.last_time = first_step, first_step - 1, time.perf_counter()

  def record(self, step: int) -> dict:
    step_time = (time.perf_counter() - self.last_time) / (step - self.last_step)
    if step == self.first:
      return {"compile_time_s": step_time, "tokens_per_sec": None, "mfu": None}
    tokens_per_sec = self.tokens_per_step / step_time
    return {"tokens_per_sec": tokens_per_sec, "step_time_s": step_time,
            "mfu": tokens_per_sec * self.flops_per_token / self.peak if self.peak else None}

  def restart(self, step: int) -> None:
    """Times the next record from here (not counting an evaluation)."""
    self.last_step, self.last_time = step, time.perf_counter()
