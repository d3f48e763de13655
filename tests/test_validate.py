"""Property: valid configs mutated at random (keys, types, values, mesh sizes)
either pass the up-front validation and then build and trace a train step, or
end with one `error: <key>: ...` line; never a traceback."""

import contextlib
import io

import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import meshtrain.config
from conftest import micro_flags
from meshtrain import cli, validate
from meshtrain.cli import common
from meshtrain.errors import ConfigError
from meshtrain.train.resume import resume_changes
from meshtrain.train.setup import build

KEYS = sorted(validate.config_keys())
VALUES = st.one_of(
    st.integers(-3, 70).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.sampled_from(["nan", "inf", "-1", "0", "1e-3", "0.5", "1.0", "1e30", "abc", "", "true",
                     "false", "xla", "cudnn", "ring", "ulysses", "all_gather_kv", "bfloat16",
                     "gpipe", "1f1b", "interleaved_1f1b", "text", "synthetic", "full",
                     "selective", "offload", "skip", "data,pipeline", "tensor"]))
MESH = st.tuples(st.sampled_from([f"mesh.{axis}" for axis in ("data", "fsdp", "tensor", "pipeline",
                                                                "sequence")]),
                 st.sampled_from(["-1", "0", "1", "2", "3", "4", "8"]))
TYPO = st.sampled_from(KEYS).flatmap(
    lambda key: st.integers(0, len(key) - 1).map(lambda i: key[:i] + key[i + 1:]))
MUTATION = st.one_of(st.tuples(st.sampled_from(KEYS), VALUES), MESH, st.tuples(TYPO, VALUES))
MUTATIONS = st.lists(MUTATION, min_size=1, max_size=4)


def checked(mutations) -> tuple[object | None, str]:
  """(the config, "") when it passes the checks `meshtrain train` runs before
  anything is created (8 devices); else (None, what the user sees)."""
  args = [*micro_flags(), *(f"--config.{key}={value}" for key, value in mutations)]
  stderr = io.StringIO()
  with contextlib.redirect_stderr(stderr):
    try:
      common.parse(cli.train.COMMAND, ["train", *args])
      cfg = common.checked_config(cli.train.CONFIG)
      validate.check_devices(cfg, jax.device_count(), jax.devices()[0].platform)
      return cfg, ""
    except SystemExit as exit_info:
      assert exit_info.code == 2
    except ConfigError as error:
      print(f"error: {error}", file=stderr)
  return None, stderr.getvalue()


def assert_one_error_line(stderr: str) -> None:
  lines = stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("error: config"), stderr
  assert "Traceback" not in stderr


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(MUTATIONS)
def test_mutated_configs_pass_or_fail_with_one_line(mutations):
  cfg, stderr = checked(mutations)
  if cfg is None:
    assert_one_error_line(stderr)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.one_of(MESH, st.tuples(st.sampled_from(
    ["seq_len", "global_batch", "model.num_heads", "model.num_kv_heads", "model.head_dim",
     "grad_accum_steps", "pipeline.microbatches"]), st.sampled_from(["1", "2", "4", "8", "16"]))),
    min_size=1, max_size=4))
def test_accepted_mutations_build_and_trace_a_step(mutations):
  """What the checks accept also compiles: the step traces and lowers (the
  errors that once surfaced only inside jit, after the workdir was written)."""
  cfg, stderr = checked(mutations)
  if cfg is None:
    assert_one_error_line(stderr)
    return
  setup = build(cfg)
  state = jax.tree.map(lambda leaf, sharding: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype,
                                                                   sharding=sharding),
                       jax.eval_shape(setup.init_state), setup.shardings)
  batch = {key: jax.ShapeDtypeStruct((cfg.global_batch, cfg.seq_len), np.int32,
                                     sharding=setup.train_step.batch_sharding)
           for key in ("inputs", "targets")}
  setup.train_step.lower(state, batch)


def test_resume_changes_list_what_breaks_exact_resume_and_nothing_else():
  from conftest import micro_config
  saved = micro_config().to_dict()
  cfg = micro_config(seed=1, steps=50, **{"data.source": "text", "optimizer.learning_rate": 1e-4})
  assert resume_changes(saved, cfg) == ["seed 0 -> 1", "data.source 'synthetic' -> 'text'"]
  del saved["data"]  # a key the checkpoint predates is not compared
  assert resume_changes(saved, cfg) == ["seed 0 -> 1"]
  # How the model runs may change; what it is may not (a key that has left
  # `model` since the checkpoint is not compared).
  saved["model"]["moe"]["grouped_gemm"] = "tiled"
  cfg = micro_config(**{"experts.grouped_gemm": "ragged_dot", "experts.dispatch": "ragged",
                        "attention.implementation": "xla", "model.moe.num_experts": 4})
  assert resume_changes(saved, cfg) == ["model.moe.num_experts 0 -> 4"]


def test_a_key_that_has_moved_is_refused_naming_where_it_went():
  from conftest import micro_config
  for old, new in meshtrain.config.MOVED.items():
    cfg = micro_config()
    section, _, name = old.rpartition(".")
    cfg[section][name] = "tiled"  # as a config file written before the move sets it
    with pytest.raises(ConfigError, match=rf"^config\.{old}: has moved to config\.{new} "):
      validate.check_values(cfg)
