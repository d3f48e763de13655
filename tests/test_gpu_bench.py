"""bench/gpu.py on the CPU: the harness a GPU session runs must work before it gets there."""

import pytest
import argparse
import importlib.util
import math

from conftest import REPO

spec = importlib.util.spec_from_file_location("gpu_bench", REPO / "bench" / "gpu.py")
gpu = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpu)


def test_one_setting_counts_the_model_flops_of_the_palm_formula():
  row = gpu.run_one("tiny", batch_size=2, seq_len=32, steps=1, warmup=0,
                    changes=gpu.SETTINGS["selective-xla"][0])
  # configs/tiny.py by hand: 4 layers of q (128x4x32), k, v (128x2x32 each),
  # o (4x32x128), gate, up (128x384 each), down (384x128), and the untied head
  # (128x256); the embedding lookup is no matmul. Attention: 12·L·H·Q·T.
  layer = 128 * 4 * 32 * 2 + 128 * 2 * 32 * 2 + 128 * 384 * 3
  matmul_weights = 4 * layer + 128 * 256
  assert row["flops_per_token"] == 6 * matmul_weights + 12 * 4 * 4 * 32 * 32
  assert row["attention"] == "xla" and row["mfu"] is None  # a CPU has no bf16 peak in the table
  assert math.isclose(row["tokens_per_s"], 2 * 32 / row["step_s"])
  assert abs(row["loss"] - math.log(256)) < 1.0  # random tokens, barely trained


@pytest.mark.slow
def test_a_failing_or_slow_setting_becomes_a_row_not_a_crash():
  args = argparse.Namespace(model="tiny", batch=2, seq=32, steps=1, warmup=0, timeout=120)
  failed = gpu.measure(args, "none-cudnn")  # no cuDNN on a CPU
  # jax says so in Python, or (where the dev extra installed cuDNN's library)
  # when it lowers the kernel for the CPU
  assert set(failed) == {"setting", "error"} and failed["setting"] == "none-cudnn"
  assert failed["error"] in ("RuntimeError: cuDNN is not detected.",
                             "NotImplementedError: MLIR translation rule for primitive "
                             "'dot_product_attention_fwd' not found for platform cpu")
  args.timeout = 1  # less than importing jax takes
  assert gpu.measure(args, "selective-xla")["error"] == "timed out after 1 s"
