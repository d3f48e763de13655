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

from conftest import REPO, micro_config, micro_flags
from test_chat import FAMILIES as CHAT_FAMILIES, numbered_conversations, save_tokenizer, \
    write_conversations
from meshtrain.data import make_iterator
from meshtrain.data.prepare import prepare
from meshtrain.errors import ConfigError
from meshtrain.train.evaluate import Evaluator, evaluate_checkpoint, evaluator_for
from meshtrain.train.loop import train
from meshtrain.train.setup import build
from meshtrain.workdir import load_config


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, real_text):
  out = tmp_path_factory.mktemp("prepared") / "text"
  prepare([str(real_text)], "bytes", str(out), split_blank_lines=True, val_fraction=0.1)
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
    {"mesh.data": 8, "zero_stage": 3, "grad_accum_steps": 2},
    {"mesh.data": 4, "mesh.pipeline": 2, "pipeline.microbatches": 2}])
def test_eval_loss_on_a_mesh_equals_plain_jit_on_one_device(corpus, initial, mesh):
  cfg = eval_config(corpus, **mesh)
  setup = build(cfg)
  params, expected = initial
  params = jax.device_put(params, setup.shardings.params)
  evaluator = Evaluator(setup)
  first, second = evaluator(params), evaluator(params)
  assert first == second and evaluator.traces == 1  # same batches, compiled once
  np.testing.assert_allclose(first["eval_loss"], expected, rtol=2e-6)
  assert first["eval_perplexity"] == pytest.approx(math.exp(first["eval_loss"]))


def test_the_loop_evaluates_every_n_steps_and_at_the_last_and_resumes_exactly(corpus, tmp_path):
  cfg = eval_config(corpus, **{"eval.every_steps": 2, "steps": 5, "log_every": 1,
                               "workdir": str(tmp_path), "mesh.data": 8, "data.packing": "segments",
                               "checkpoint.every_steps": 2})
  records = train(cfg)
  assert [r["step"] for r in records if "eval_loss" in r] == [2, 4, 5]
  logged = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert [r for r in logged if "eval_loss" in r] == [r for r in records if "eval_loss" in r]
  evals = [r["eval_loss"] for r in records if "eval_loss" in r]
  assert evals[0] > evals[-1]  # the micro model learns the bytes' frequencies in 5 steps
  assert any(b"eval_perplexity" in f.read_bytes() for f in (tmp_path / "tensorboard").iterdir())
  # From the checkpoint, on another mesh: the loop's last evaluation.
  saved = load_config(str(tmp_path), {"mesh.data": 2, "mesh.fsdp": 4})
  result = evaluate_checkpoint(saved, str(tmp_path), 5)
  np.testing.assert_allclose(result["eval_loss"], evals[-1], rtol=1e-6)
  # Stopped after step 2 and resumed: the same batches, losses and evaluations, bit for bit.
  cfg.workdir = str(tmp_path / "resumed")
  cfg.checkpoint.restore_from = str(tmp_path / "checkpoints/2")
  resumed = train(cfg)
  assert [r["step"] for r in resumed] == [3, 4, 5]
  for key in ("loss", "eval_loss"):
    assert [r.get(key) for r in resumed] == [r.get(key) for r in records if r["step"] > 2]


def test_eval_refuses_what_it_cannot_do(corpus, real_text):
  with pytest.raises(ConfigError, match="config.eval.every_steps"):
    evaluator_for(build(eval_config(corpus, **{"eval.every_steps": -1})))
  with pytest.raises(ConfigError, match="config.eval.batches"):
    Evaluator(build(eval_config(corpus, **{"eval.batches": 0})))
  with pytest.raises(ConfigError, match="no validation split"):
    Evaluator(build(micro_config(**{"data.source": "text", "data.path": str(real_text),
                                    "model.vocab_size": 256})))


@pytest.mark.slow
def test_cli_refuses_a_missing_step_on_one_line(corpus, tmp_path):
  (tmp_path / "checkpoints/3").mkdir(parents=True)
  (tmp_path / "config.json").write_text(json.dumps(eval_config(corpus).to_dict()))
  before = sorted(tmp_path.rglob("*"))
  result = subprocess.run([sys.executable, "-m", "meshtrain.cli", "eval", f"--workdir={tmp_path}",
                           "--step=7"], capture_output=True, text=True, cwd=REPO, timeout=300)
  assert result.returncode == 2 and result.stderr.strip().splitlines() == [
      f"error: --step: {tmp_path} has no checkpoint of step 7; it has [3]"]
  assert sorted(tmp_path.rglob("*")) == before


@pytest.mark.slow
def test_two_processes_of_four_devices_read_and_evaluate_like_one_of_eight(corpus, tmp_path):
  """The prepared corpus's batches (packed with segments), split by process rows,
  give the losses and evaluations of one process."""
  changes = {"data.source": "tokens", "data.path": str(corpus), "data.packing": "segments",
             "model.vocab_size": 256, "eval.batches": 2, "eval.every_steps": 2, "steps": 3,
             "mesh.data": 2, "mesh.fsdp": 4}
  result = subprocess.run(
      [sys.executable, "-m", "meshtrain.cli", "launch", "--num_processes=2",
       "--devices_per_process=4", "--", "train", f"--config.workdir={tmp_path / 'two'}",
       *micro_flags(**changes)], capture_output=True, text=True, timeout=400, cwd=REPO)
  assert result.returncode == 0, result.stderr[-3000:]
  assert "batch rows range(8, 16)" in result.stdout
  two = [json.loads(line) for line in (tmp_path / "two/metrics.jsonl").read_text().splitlines()]
  one = train(micro_config(**changes, workdir=str(tmp_path / "one")))
  for key in ("loss", "eval_loss"):
    np.testing.assert_allclose([r.get(key, 0) for r in two], [r.get(key, 0) for r in one],
                               rtol=1e-5)
  assert [r["step"] for r in two if "eval_loss" in r] == [2, 3]


def test_a_prepared_corpus_pads_the_vocabulary_to_a_multiple_of_tensor(corpus):
  from meshtrain.train.run import padded_vocab, resolve
  cfg = eval_config(corpus, **{"model.vocab_size": 257, "mesh.data": 2, "mesh.tensor": 4})
  assert resolve(cfg).cfg.model.vocab_size == 260 and cfg.model.vocab_size == 257
  synthetic = micro_config(**{"model.vocab_size": 65, "mesh.data": 2, "mesh.tensor": 4})
  assert padded_vocab(synthetic, 4) is synthetic  # the task's vocabulary is the task


def test_a_chat_corpus_evaluates_the_mean_over_the_assistant_tokens_of_all_batches(tmp_path):
  """Prepared conversations: the evaluation on `data=2 x fsdp=4`, accumulating
  2 microbatches, is the plain mean over every counted target (an assistant
  token, not padding) of its batches, computed here on one device."""
  tokenizer = save_tokenizer(tmp_path / "tokenizer", CHAT_FAMILIES["qwen2.5"])
  inputs = write_conversations(tmp_path / "chat.jsonl", numbered_conversations(60))
  prepare([str(inputs)], str(tokenizer), str(tmp_path / "out"), input_format="chat",
          val_fraction=0.3)
  cfg = micro_config(**{"data.source": "tokens", "data.path": str(tmp_path / "out"),
                        "data.packing": "segments", "model.vocab_size": 400, "eval.batches": 2,
                        "mesh.data": 2, "mesh.fsdp": 4, "grad_accum_steps": 2})
  setup = build(cfg)
  params = setup.init_state().params
  got = Evaluator(setup)(params)["eval_loss"]
  graphdef = setup.spec.graphdef  # local attention: it runs as well on one device
  one = jax.device_put(jax.device_get(params), jax.devices()[0])
  batches = make_iterator(cfg.data, seq_len=cfg.seq_len, global_batch=cfg.global_batch,
                          vocab_size=400, seed=cfg.seed, split="val")
  total = count = 0.0
  for batch in (next(batches) for _ in range(2)):
    logits = nnx.merge(graphdef, one)(batch["inputs"], segment_ids=batch["segment_ids"],
                                     positions=batch["positions"])
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
    counted = (batch["segment_ids"] != 0) & (batch["loss_mask"] != 0)
    total, count = total + float((losses * counted).sum()), count + float(counted.sum())
  assert 0 < count < 2 * batch["targets"].size  # some tokens count, not all
  np.testing.assert_allclose(got, total / count, rtol=2e-6)
