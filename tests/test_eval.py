"""Tests for evaluation: against a plain one-device loss, on every strategy's mesh, in the loop and from a checkpoint."""

import json
import math
import subprocess
import sys

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from conftest import REPO, SHAKESPEARE, micro_config, micro_flags
from meshtrain.data import make_iterator
from meshtrain.data.prepare import prepare
from meshtrain.errors import ConfigError
from meshtrain.evaluate import Evaluator, evaluate_checkpoint, saved_config
from meshtrain.train.loop import train
from meshtrain.train.setup import build


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
  out = tmp_path_factory.mktemp("prepared") / "shakespeare"
  prepare([str(SHAKESPEARE)], "bytes", str(out), split_blank_lines=True, val_fraction=0.1)
  return out


def eval_config(corpus, **changes):
  return micro_config(**{"data.source": "tokens", "data.path": str(corpus),
                         "model.vocab_size": 256, "eval.batches": 2, **changes})


def reference_eval_loss(cfg, params) -> float:
  """Plain jit on one device, optax's cross-entropy, the validation split's first batches."""
  graphdef = build(micro_config(**{"model.vocab_size": cfg.model.vocab_size}),
                   jax.devices()[:1]).spec.graphdef
  params = jax.device_put(jax.device_get(params), jax.devices()[0])
  batches = make_iterator(cfg.data, seq_len=cfg.seq_len, global_batch=cfg.global_batch,
                          vocab_size=cfg.model.vocab_size, seed=cfg.seed, split="val")

  @jax.jit
  def loss(params, batch):
    logits = nnx.merge(graphdef, params)(batch["inputs"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()

  return float(np.mean([loss(params, next(batches)) for _ in range(cfg.eval.batches)]))


@pytest.fixture(scope="module")
def initial(corpus):
  """Initial weights on the host and their reference evaluation (the same for every mesh)."""
  cfg = eval_config(corpus)
  params = jax.device_get(build(cfg, jax.devices()[:1]).spec.init())
  return params, reference_eval_loss(cfg, params)


@pytest.mark.parametrize("mesh", [
    {"mesh.data": 8}, {"mesh.data": 1, "mesh.fsdp": 8},
    {"mesh.data": 2, "mesh.fsdp": 2, "mesh.tensor": 2, "tensor_sequence_parallel": True},
    {"mesh.data": 4, "mesh.sequence": 2, "attention.sequence_strategy": "ring"},
    {"mesh.data": 4, "mesh.sequence": 2, "attention.sequence_strategy": "ulysses"},
    {"mesh.data": 8, "zero_stage": 3, "grad_accum_steps": 2}])
def test_eval_loss_on_a_mesh_equals_plain_jit_on_one_device(corpus, initial, mesh):
  cfg = eval_config(corpus, **mesh)
  setup = build(cfg)
  params, expected = initial
  params = jax.device_put(params, setup.shardings.params)
  evaluator = Evaluator(cfg, setup)
  first, second = evaluator(params), evaluator(params)
  assert first == second and evaluator.traces == 1  # same batches, compiled once
  np.testing.assert_allclose(first["eval_loss"], expected, rtol=2e-6)
  assert first["eval_perplexity"] == pytest.approx(math.exp(first["eval_loss"]))


def test_the_loop_evaluates_every_n_steps_and_at_the_last(corpus, tmp_path):
  cfg = eval_config(corpus, **{"eval.every_steps": 2, "steps": 5, "log_every": 10,
                               "workdir": str(tmp_path), "mesh.data": 8})
  records = train(cfg)
  assert [r["step"] for r in records if "eval_loss" in r] == [2, 4, 5]
  logged = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert [r for r in logged if "eval_loss" in r] == [r for r in records if "eval_loss" in r]
  evals = [r["eval_loss"] for r in records if "eval_loss" in r]
  assert evals[0] > evals[-1]  # the micro model learns the bytes' frequencies in 5 steps
  assert any(b"eval_perplexity" in f.read_bytes() for f in (tmp_path / "tensorboard").iterdir())
  # From the checkpoint, on another mesh: the loop's last evaluation.
  saved = saved_config(str(tmp_path))
  saved.mesh.data, saved.mesh.fsdp = 2, 4
  result = evaluate_checkpoint(saved)
  assert result["step"] == 5
  np.testing.assert_allclose(result["eval_loss"], evals[-1], rtol=1e-6)


def test_eval_refuses_what_it_cannot_do(corpus, tmp_path):
  with pytest.raises(ConfigError, match="config.eval.every_steps"):
    train(eval_config(corpus, **{"eval.every_steps": 2, "mesh.data": 4, "mesh.pipeline": 2,
                                 "workdir": str(tmp_path / "pipe")}))
  with pytest.raises(ConfigError, match="config.eval.batches"):
    Evaluator(eval_config(corpus, **{"eval.batches": 0}), build(eval_config(corpus)))
  with pytest.raises(ConfigError, match="no validation split"):
    Evaluator(micro_config(**{"data.source": "text", "data.path": str(SHAKESPEARE),
                              "model.vocab_size": 256}), build(eval_config(corpus)))
  with pytest.raises(ConfigError, match="--workdir: .* holds no config.json"):
    saved_config(str(tmp_path / "nothing"))
  assert not (tmp_path / "pipe").exists() and not (tmp_path / "nothing").exists()


def test_cli_evaluates_a_saved_run_and_refuses_a_missing_step(corpus, tmp_path):
  flags = micro_flags(**{"data.source": "tokens", "data.path": corpus, "model.vocab_size": 256,
                         "steps": 2, "workdir": tmp_path})
  train_run = subprocess.run([sys.executable, "-m", "meshtrain.cli", "train", *flags,
                              "--config.simulate_devices=8"],
                             capture_output=True, text=True, cwd=REPO, timeout=300)
  assert train_run.returncode == 0, train_run.stderr[-2000:]
  command = [sys.executable, "-m", "meshtrain.cli", "eval", f"--workdir={tmp_path}"]
  result = subprocess.run(command + ["--config.mesh.fsdp=2"], capture_output=True, text=True,
                          cwd=REPO, timeout=300)
  assert result.returncode == 0, result.stderr[-2000:]
  record = json.loads(result.stdout.strip().splitlines()[-1])
  cfg = saved_config(str(tmp_path))
  from meshtrain.checkpoint import Checkpoints
  setup = build(cfg)
  checkpoints = Checkpoints(tmp_path / "checkpoints", read_only=True, config_key="k")
  state = checkpoints.restore(2, setup.shardings, setup.abstract_state(),
                              make_iterator(cfg.data, seq_len=16, global_batch=16,
                                            vocab_size=256, seed=0), cfg)
  checkpoints.close()
  assert record["step"] == 2
  np.testing.assert_allclose(record["eval_loss"], reference_eval_loss(cfg, state.params), rtol=2e-6)
  bad = subprocess.run(command + ["--step=7"], capture_output=True, text=True, cwd=REPO, timeout=300)
  assert bad.returncode == 2 and bad.stderr.strip().splitlines() == [
      f"error: --step: {tmp_path / 'checkpoints'} holds no checkpoint of step 7 (steps: 2)"]
