"""The training loop compiles its step once: logging and checkpoints cause no recompilation."""

import jax

from conftest import micro_config
from meshtrain.train.loop import describe, train
from meshtrain.train.setup import build


def test_a_run_compiles_the_train_step_once_across_logs_and_a_save(tmp_path):
  compiled = []

  def on_compile(event, duration_s, fun_name="", **_):
    if event == "/jax/core/compile/backend_compile_duration":
      compiled.append(fun_name)

  cfg = micro_config(steps=6, log_every=2, workdir=str(tmp_path))
  cfg.checkpoint.every_steps = 3
  jax.monitoring.register_event_duration_secs_listener(on_compile)
  try:
    records = train(cfg)
  finally:
    jax.monitoring.unregister_event_duration_listener(on_compile)
  assert [r["step"] for r in records] == [1, 2, 4, 6]
  assert sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir()) == [3, 6]
  assert compiled.count("jit(train_step)") == 1, compiled  # TrainStep's jitted `train_step`


def test_the_start_of_a_run_prints_the_layout_changes_nobody_asked_for():
  """Kv heads kept whole because `tensor` does not divide them, and a mesh
  axis an expert weight's `embed` cannot take (its experts dimension did)."""
  text = describe(build(micro_config(**{"mesh.data": 2, "mesh.tensor": 4,
                                        "model.num_kv_heads": 2})))
  assert "kv heads kept whole: tensor=4 does not divide model.num_kv_heads=2" in text
  text = describe(build(micro_config(**{"mesh.data": 1, "mesh.fsdp": 8,
                                        "model.moe.num_experts": 8,
                                        "model.moe.experts_per_token": 2})))
  assert ("layout: layers/mlp/w_gate_ExDxF ('layers', 'experts', 'embed', 'expert_mlp'): "
          "dimension 2 (embed) is not split over 'fsdp', which an earlier dimension uses") in text
  assert "layout:" not in describe(build(micro_config(**{"mesh.data": 8})))
