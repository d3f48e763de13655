"""The `meshtrain train` command end to end, in subprocesses as a user runs it."""

import json
import subprocess
import sys

import pytest

from conftest import REPO

MICRO = ["--config.model.embed_dim=32", "--config.model.num_layers=2", "--config.model.mlp_dim=64",
         "--config.model.head_dim=8", "--config.seq_len=16", "--config.global_batch=16"]


def meshtrain(*args, tmp_path):
  return subprocess.run(
      [sys.executable, "-m", "meshtrain.cli", "train", "--config", str(REPO / "configs/tiny.py"),
       f"--config.workdir={tmp_path / 'run'}", *MICRO, *args],
      capture_output=True, text=True, timeout=300, cwd=tmp_path)


@pytest.mark.slow
def test_train_writes_metrics_on_eight_simulated_devices(tmp_path):
  result = meshtrain("--config.simulate_devices=8", "--config.mesh.data=8", "--config.steps=4",
                     "--config.log_every=2", "--config.peak_flops=1e12", tmp_path=tmp_path)
  assert result.returncode == 0, result.stderr
  assert "on 8 cpu devices, mesh data=8" in result.stdout
  records = [json.loads(line) for line in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in records] == [1, 2, 4]
  for key in ("loss", "learning_rate", "grad_norm", "tokens_per_sec", "step_time_s", "mfu"):
    assert isinstance(records[-1][key], float), key
  assert (tmp_path / "run/config.json").exists()
  assert list((tmp_path / "run/tensorboard").glob("events.out.tfevents.*"))


@pytest.mark.slow
@pytest.mark.parametrize("args, key", [
    (["--config.simulate_devices=8", "--config.mesh.data=4"], "config.mesh"),
])
def test_bad_input_is_one_readable_line_and_a_nonzero_exit(args, key, tmp_path):
  """A process's whole stderr, start-up included, is the one line. The
  other bad inputs (a global batch `data` does not divide, a missing text
  file, ...) are test_bad_input.py's cases, the CLI run in process."""
  result = meshtrain("--config.steps=2", *args, tmp_path=tmp_path)
  assert result.returncode == 2
  lines = result.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith(f"error: {key}:"), result.stderr
  assert not (tmp_path / "run").exists()  # nothing written


@pytest.mark.slow
def test_text_data_trains_from_a_text_file_with_the_vocabulary_rounded_up_for_tensor(
    tmp_path, real_text):
  """Byte-level text under `tensor=2`: a vocabulary of 257 (not divisible by
  2) is rounded up to 258, printed and saved in the run's config."""
  result = meshtrain("--config.data.source=text", f"--config.data.path={real_text}",
                     "--config.model.vocab_size=257", "--config.simulate_devices=8",
                     "--config.mesh.data=4", "--config.mesh.tensor=2", "--config.steps=2",
                     tmp_path=tmp_path)
  assert result.returncode == 0, result.stderr
  assert "model.vocab_size 257 -> 258, a multiple of mesh.tensor = 2" in result.stdout
  saved = json.loads((tmp_path / "run/config.json").read_text())
  assert saved["model"]["vocab_size"] == 258


@pytest.mark.slow  # a process of its own
def test_schedule_prints_json_and_draws(tmp_path):
  result = subprocess.run(
      [sys.executable, "-m", "meshtrain.cli", "schedule", "--stages=4", "--microbatches=8",
       "--schedule=1f1b", "--json", f"--out={tmp_path / '1f1b.png'}"],
      capture_output=True, text=True, timeout=120, cwd=tmp_path)
  assert result.returncode == 0, result.stderr
  summary = json.loads(result.stdout)
  assert summary["bubble_fraction"] == pytest.approx(6 / 30)  # F, B, W one tick each
  assert summary["peak_in_flight"] == [4, 3, 2, 1]  # Megatron's p - s
  assert (tmp_path / "1f1b.png").stat().st_size > 10_000
