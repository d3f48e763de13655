"""Uneven pipeline stages (`config.pipeline.stage_layers`): the layout's
slots, and a checkpoint read on another layout. Training on them equals one
device: tests/test_pipeline_runtime.py (every schedule, the executor) and
tests/test_pipeline_equivalence.py, tests/test_moe.py (configs)."""

import jax
import numpy as np
import pytest

from conftest import micro_config
from meshtrain.analysis import selfcheck
from meshtrain.parallel.pipeline.stages import StageLayout
from meshtrain.train.loop import train
from meshtrain.train.parallelize import from_stage_slots
from meshtrain.train.setup import build
from meshtrain.workdir import load_params


def test_slots_hold_each_chunk_from_its_first_slot():
  # 5 layers, chunks of 1, 2, 1, 1 (P = 2 stages x V = 2): S = 2 slots a chunk.
  layout = StageLayout.parse("1,2,1,1", 5, 2, 2)
  assert (layout.num_chunks, layout.slots, layout.even_split) == (2, 2, False)
  np.testing.assert_array_equal(layout.slot_of_layer(), [0, 2, 3, 4, 6])
  np.testing.assert_array_equal(layout.counts_VxP(), [[1, 2], [1, 1]])
  layers = np.arange(5.0)[:, None] + 1
  slotted = layout.to_slots(layers)
  np.testing.assert_array_equal(slotted[:, 0], [1, 0, 2, 3, 4, 0, 5, 0])
  np.testing.assert_array_equal(layout.from_slots(slotted), layers)
  even = StageLayout.parse("", 4, 2, 1)
  assert even.counts == (2, 2) and even.to_slots(layers) is layers
  assert StageLayout.parse("2,2", 4, 2, 1).stores_like(StageLayout.parse("1,1,1,1", 4, 4, 1))
  # Llama 3 405B's: 126 layers on 16 stages, one fewer on the first and the last.
  assert StageLayout.balanced(126, 16, 1).counts == (7,) + (8,) * 14 + (7,)
  assert StageLayout.balanced(7, 2, 2).counts == (2, 2, 2, 1)


@pytest.mark.parametrize("text,words", [
    ("3,x", "comma-separated"), ("2,2,2", "3 counts for 2 stages x 1 chunks"),
    ("0,4", "at least one layer"), ("2,3", "add up to 5 layers, the model has 4")])
def test_layouts_that_do_not_fit_say_why(text, words):
  with pytest.raises(ValueError, match=words):
    StageLayout.parse(text, 4, 2, 1)


UNEVEN = {"mesh.data": 2, "mesh.pipeline": 4, "pipeline.stage_layers": "1,2,2,1"}


def test_verify_of_uneven_stages_compares_cleanly():
  """`meshtrain verify` runs the plain model on the state's slots: an empty
  slot, all zeros, adds nothing and gets a zero gradient, so the sharded step
  and the plain one agree there too."""
  report = selfcheck.verify_config(micro_config(**{"model.num_layers": 6, **UNEVEN}), steps=2)
  assert report.ok(), report.format()


def run_config(workdir, **changes):
  return micro_config(**{"model.num_layers": 6, "workdir": str(workdir), "steps": 4,
                         "log_every": 1, "checkpoint.every_steps": 2, **UNEVEN, **changes})


@pytest.mark.slow
def test_a_checkpoint_resumes_on_other_layouts(tmp_path):
  """A run on "1,2,2,1" restored at step 2 onto 4 + 2 layers on two stages
  and onto no pipeline continues as the straight run does (float32
  rounding), its final weights the same."""
  straight = train(run_config(tmp_path / "straight"))
  restore = str(tmp_path / "straight/checkpoints/2")
  want = [r["loss"] for r in straight if r["step"] > 2]
  final = {}
  for name, layout in {"straight": UNEVEN,
                       "4,2": {"mesh.data": 4, "mesh.pipeline": 2, "pipeline.stage_layers": "4,2"},
                       "none": {"mesh.data": 8, "mesh.pipeline": 1, "pipeline.stage_layers": ""}
                       }.items():
    cfg = run_config(tmp_path / name, **layout, **{"checkpoint.restore_from": restore})
    if name != "straight":
      got = [r["loss"] for r in train(cfg) if r["step"] > 2]
      np.testing.assert_allclose(got, want, rtol=1e-5, err_msg=name)
    setup = build(cfg)
    final[name] = jax.device_get(from_stage_slots(setup.run.layout, load_params(
        cfg.workdir, 4, setup.spec.abstract_params, setup.shardings.params)))
  for name in ("4,2", "none"):
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=3e-6),
                 final[name], final["straight"])
