"""Where a run starts when its workdir holds a finished checkpoint: its own
config's finished run (nothing to do, nothing written), another config's (an
error naming the differences), or a longer run of its own (a note of how the
learning-rate schedule changes, checked against the rates the steps logged)."""

import hashlib
import json
import re
import shutil

import pytest

from conftest import micro_config
from meshtrain.errors import ConfigError
from meshtrain.train.loop import train


def digest(root) -> dict[str, str]:
  return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file()
          else "folder" for p in sorted(root.rglob("*"))}


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
  """A workdir whose run of `micro_config` finished its 5 steps."""
  workdir = tmp_path_factory.mktemp("finished") / "run"
  train(micro_config(workdir=str(workdir)))
  return workdir


def test_a_finished_run_of_the_same_config_has_nothing_to_do_and_writes_nothing(finished):
  before = digest(finished)
  assert train(micro_config(workdir=str(finished), **{"distributed.timeout_s": 60})) == []
  assert digest(finished) == before


def test_a_finished_run_of_another_config_is_an_error_naming_the_differences(finished):
  before = digest(finished)
  other = micro_config(workdir=str(finished), zero_stage=1, **{"optimizer.learning_rate": 1e-3})
  with pytest.raises(ConfigError, match=r"config.workdir: .*run holds a finished run \(step 5\) "
                     r"of another config \(optimizer.learning_rate 0.003 -> 0.001, zero_stage "
                     r"0 -> 1\); give this run its own --config.workdir"):
    train(other)
  assert digest(finished) == before


def test_a_resume_with_more_steps_says_how_the_learning_rate_changes(finished, tmp_path, capsys):
  workdir = tmp_path / "run"
  shutil.copytree(finished, workdir)
  capsys.readouterr()
  train(micro_config(workdir=str(workdir), steps=12))
  note = re.search(r"note: steps 5 -> 12: .* step 6 runs at (\S+) where the checkpoint's "
                   r"schedule gives (\S+) \(step 5 ran at (\S+)\)", capsys.readouterr().out)
  assert note, "no note of the schedule's change"
  logged = {r["step"]: r["learning_rate"] for r in map(json.loads, (
      workdir / "metrics.jsonl").read_text().splitlines())}
  assert float(note.group(1)) == pytest.approx(logged[6], rel=1e-2)
  assert float(note.group(3)) == pytest.approx(logged[5], rel=1e-2)
  # the 5-step schedule had decayed to its floor (0.1 x 3e-3): step 6 jumps above it
  assert float(note.group(2)) == pytest.approx(3e-4, rel=1e-2)
  assert logged[6] > 2 * float(note.group(2))
