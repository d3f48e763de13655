"""What a llama_8b-shaped layer keeps for its backward (abstract values: nothing
runs), read from jax: no weight-sized residual, 16-bit tensors only where
they are activation-sized, the attention probabilities once, and exactly the
bytes counted by hand below."""

import importlib.util

import pytest

from conftest import REPO

spec = importlib.util.spec_from_file_location("layer_residuals",
                                              REPO / "bench" / "layer_residuals.py")
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)

BATCH, SEQ = 3, 2048  # sizes no weight dimension equals
CFG = bench.LLAMA_8B


@pytest.fixture(scope="module")
def residuals():
  return {remat: bench.layer_residuals(CFG, BATCH, SEQ, remat)
          for remat in ("none", "selective", "full")}


def test_no_residual_is_computed_from_weights_alone(residuals):
  """A residual without the batch dimension came from the weights only (the
  fused q/k/v and gate/up concatenations once were: 285 MB per layer)."""
  for remat, saved in residuals.items():
    assert all(BATCH in r.shape for r in saved), (remat, [r for r in saved if BATCH not in r.shape])


def test_activation_sized_residuals_are_16_bit_and_scores_kept_once(residuals):
  saved = residuals["none"]
  big = [r for r in saved if r.bytes >= BATCH * SEQ * CFG.embed_dim]
  assert {r.dtype for r in big} == {"bfloat16"}, [r for r in big if r.dtype != "bfloat16"]
  scores = [r for r in saved if r.shape.count(SEQ) == 2]
  assert len(scores) == 1 and scores[0].dtype == "bfloat16", scores


def test_bytes_per_layer_match_the_count_by_hand(residuals):
  """In sbh units (bytes / (s b h)), bfloat16, d = h = embed_dim:
  none: layer input, two norm outputs, the residual between attention and MLP
  (2 each); q and attention output (2 N H / d each), rotated k and v
  (2 K H / d each); the probabilities 2 N s / d; gate, up and their product
  (2 F / d each); rotary's float32 sin and cos for q and k (4 x 4 (H/2) / d).
  selective: the input, q/k/v, attention output projection, gate/up outputs.
  full: the input only."""
  d, n, k, h, f = CFG.embed_dim, CFG.num_heads, CFG.num_kv_heads, CFG.head_dim, CFG.mlp_dim
  expected = {
      "none": 4 * 2 + 2 * 2 * n * h / d + 2 * 2 * k * h / d + 2 * n * SEQ / d + 3 * 2 * f / d
              + 4 * 4 * (h / 2) / d,
      "selective": 2 + 2 * (n + 2 * k) * h / d + 2 + 2 * 2 * f / d,
      "full": 2,
  }
  measured = {remat: bench.sbh(saved, BATCH, SEQ, d) for remat, saved in residuals.items()}
  assert measured == pytest.approx(expected, rel=1e-6)
  # Megatron's GPT layer (Korthikanti et al. 2022) for the same shape saves more without recompute.
  assert measured["none"] < 0.6 * bench.megatron_sbh(CFG, SEQ)["none"]


def test_selective_keeps_exactly_the_named_matmul_outputs(residuals):
  named = {r.source.split("'")[1] for r in residuals["selective"] if r.source.startswith("named")}
  unnamed = [r for r in residuals["selective"]
             if not r.source.startswith(("named", "from the argument x"))]
  assert named == {"qkv", "attn_out", "mlp_in"} and not unnamed, unnamed
