"""Every test runs on 8 simulated CPU devices (set before jax touches a device).

Two tiers: `pytest -m "not slow"` runs every strategy and feature once;
`pytest` runs everything (the `slow` marker: subprocesses, notebooks, many
compiles, more cases of a strategy family). The run's programs go into one
persistent compilation cache, which the CLI subprocesses and notebook kernels
it starts share through the environment.
"""

import atexit
import collections
import os
import shutil
import sys
import tempfile
from pathlib import Path

# LLVM at -O0 and XLA:CPU's older (non-MLIR) fusion emitters: each halves
# compile times; tests time no kernels.
FAST_COMPILE_FLAGS = "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8 " + FAST_COMPILE_FLAGS
                           ).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:  # one cache per run, removed after it
  os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="meshtrain-tests-jax-cache-")
  atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
  os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
  os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"

import meshtrain  # noqa: E402,F401 (first: it keeps jax's CUDA plugin quiet where no GPU is)
import jax  # noqa: E402
import pytest  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

import corpus  # noqa: E402

pytest_plugins = ["compile_counts"]  # the run's XLA compiles, after the tests


@pytest.fixture(scope="session", autouse=True)
def eight_devices():
  assert jax.device_count() == 8, "tests expect 8 simulated CPU devices"


@pytest.fixture(scope="session")
def real_text(tmp_path_factory) -> Path:
  """About 1.1 MB of real English text (`corpus`), on any machine."""
  return corpus.real_text(tmp_path_factory.mktemp("text"))


def cli_in_process(argv: list[str], capfd) -> tuple[int, str, str]:
  """`meshtrain ARGV` run in this process (for a test of what a command
  says, not of a fresh process): its exit code and what it wrote to file
  descriptors 1 and 2 (by Python or by native code)."""
  from meshtrain import cli
  capfd.readouterr()
  with pytest.raises(SystemExit) as exit_info:
    cli.run(argv)
  out, err = capfd.readouterr()
  return exit_info.value.code or 0, out, err


# For a test that reads the buffers of a compiled CPU program (its copies,
# its temporaries): XLA:CPU's default fusion emitters, as users compile it.
USERS_CPU_COMPILE = {"xla_cpu_use_fusion_emitters": True}


# A model small enough to compile and run in about a second on 2 cores.
MICRO = {"model.vocab_size": 64, "model.embed_dim": 32, "model.num_layers": 2,
         "model.num_heads": 4, "model.num_kv_heads": 2, "model.head_dim": 8, "model.mlp_dim": 64,
         "seq_len": 16, "global_batch": 16, "steps": 5, "log_every": 1,
         "optimizer.warmup_steps": 2}


def tiered(cases, quick):
  """`cases` (ids) as parametrize values, all but the `quick` ones marked slow."""
  return [pytest.param(case, id=str(case), marks=() if case in quick else pytest.mark.slow)
          for case in cases]


def micro_config(**changes):
  """The default config with MICRO and `changes` ({"mesh.fsdp": 8, ...}) applied."""
  from meshtrain.config import get_config
  cfg = get_config()
  for key, value in {**MICRO, **changes}.items():
    section, _, name = key.rpartition(".")
    (cfg[section] if section else cfg)[name] = value
  return cfg


def micro_flags(**changes) -> list[str]:
  """The same config as `micro_config(**changes)`, as `meshtrain train` flags."""
  return [f"--config.{key}={value}" for key, value in {**MICRO, **changes}.items()]


def step_collectives(compiled, mesh) -> dict:
  """The compiled step's collectives by (kind, axis): count and bytes, in
  loops and out of them, as `plan` gives them."""
  from meshtrain.analysis import hlo

  totals = collections.defaultdict(lambda: {"count": 0, "bytes": 0})
  for c in hlo.collectives(compiled, mesh):
    totals[c.kind, c.axis]["count"] += c.count
    totals[c.kind, c.axis]["bytes"] += c.bytes
  return totals
