"""The README's cheap commands (its ```bash blocks) run as written: each
block, its commands in order, on a fresh directory that holds what a clone
holds (configs/ and the installed .venv; the set-up, GPU and Slurm commands
are ```sh blocks, shown and not run). `input.txt`, which the README downloads
with curl, is written here from real English text (`corpus`). Each block must
exit 0, on one simulated CPU device as a user's machine has, unless it asks
for more, and leave the file its block is run for (`LEAVES`). The blocks
train, so they compile as users do: under the tests' `FAST_COMPILE_FLAGS`
their steps run at LLVM -O0 and lose more than the compiles save
(docs/test_time.md)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO

README = REPO / "README.md"


def bash_blocks(text: str) -> list[str]:
  return re.findall(r"^```bash\n(.*?)^```", text, re.M | re.S)


def test_the_readme_is_a_front_door():
  text = README.read_text()
  assert len(text.splitlines()) <= 250
  blocks = bash_blocks(text)
  assert blocks[0].startswith(".venv/bin/meshtrain train --config configs/tiny.py")
  for link in re.findall(r"\]\(((?:docs/)[^)#]+)", text):  # every page and picture it links
    assert (REPO / link).exists(), link
  assert "PRESETS_TABLE" not in text  # the presets table is filled in


# What each block leaves, by the command it starts with.
LEAVES = {".venv/bin/meshtrain train --config configs/tiny.py": "runs/tiny/metrics.png",
          ".venv/bin/meshtrain train --config configs/megatron_3d.py": "runs/megatron_3d_tiny/checkpoints/20",
          ".venv/bin/meshtrain plan": "1f1b.png",
          ".venv/bin/meshtrain prepare": "runs/shakespeare_bpe/checkpoints/100"}


def test_every_block_is_checked_for_what_it_leaves():
  blocks = bash_blocks(README.read_text())
  assert len(blocks) == len(LEAVES)
  for block, start in zip(blocks, LEAVES):
    assert block.startswith(start), (start, block)


@pytest.mark.slow
@pytest.mark.parametrize("start", LEAVES)
def test_a_readme_block_runs_as_written_on_a_fresh_directory(start, tmp_path, real_text):
  block = next(b for b in bash_blocks(README.read_text()) if b.startswith(start))
  (tmp_path / "configs").symlink_to(REPO / "configs")
  (tmp_path / ".venv").symlink_to(Path(sys.prefix))
  (tmp_path / "input.txt").write_bytes(real_text.read_bytes())
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
  result = subprocess.run(["bash", "-euo", "pipefail", "-c", block], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=900)
  assert result.returncode == 0, f"{block}\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}"
  assert (tmp_path / LEAVES[start]).exists(), LEAVES[start]


def test_ci_runs_the_readmes_set_up_and_test_command():
  """The README's two set-up commands: the main job, then the tests exactly as CI runs them."""
  setup = re.search(r"^## Set up\n.*?^```sh\n(.*?)^```", README.read_text(), re.M | re.S).group(1)
  train, tests = setup.strip().splitlines()
  assert train.endswith(".venv/bin/meshtrain train --config configs/tiny.py")
  assert (REPO / ".ci/run").read_text().strip().splitlines()[-1] == tests
