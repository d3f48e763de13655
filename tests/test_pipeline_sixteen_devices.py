"""A 16-device mesh with four axes larger than one (data, pipeline, fsdp,
tensor, each 2) trains like one device, in its own process (the test session
has 8 devices)."""

import pytest
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

from conftest import FAST_COMPILE_FLAGS

SCRIPT = f"""
import os
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=16 {FAST_COMPILE_FLAGS}"
os.environ["JAX_PLATFORMS"] = "cpu"
import sys
import jax
assert jax.device_count() == 16
sys.path.insert(0, "tests")
from conftest import micro_config
from equivalence import assert_matches_one_device
from reference import random_batches

cfg = micro_config()
cfg.update(dict(mesh=dict(data=2, pipeline=2, fsdp=2, tensor=2), pipeline=dict(schedule="zb_h1"),
                zero_stage=1))
batches = random_batches(3, cfg.global_batch, cfg.seq_len, cfg.model.vocab_size)
print("losses", assert_matches_one_device(cfg, batches)[1])
"""


@pytest.mark.slow
def test_pipeline_fsdp_tensor_data_on_sixteen_devices():
  env = {**os.environ, "PYTHONPATH": str(REPO)}
  env.pop("XLA_FLAGS", None)
  result = subprocess.run([sys.executable, "-c", SCRIPT], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=900)
  assert result.returncode == 0, result.stderr[-3000:]
  assert "losses" in result.stdout
