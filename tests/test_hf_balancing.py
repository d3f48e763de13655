"""An MoE checkpoint's load balancing comes with its import (import-hf, and
configs/finetune_hf.py on a Hugging Face directory), in meshtrain's convention,
with a note; a value the config sets itself stays."""

import json

import pytest

from conftest import REPO
from meshtrain import config, hf_import
from meshtrain.hf import config as hf_config, importer

MIXTRAL = {"model_type": "mixtral", "architectures": ["MixtralForCausalLM"], "vocab_size": 64,
           "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
           "num_key_value_heads": 2, "head_dim": 8, "intermediate_size": 24,
           "num_local_experts": 4, "num_experts_per_tok": 2, "router_aux_loss_coef": 0.02,
           "rms_norm_eps": 1e-5, "rope_theta": 10000.0}


def test_mixtrals_coefficient_is_k_times_in_meshtrains_convention(tmp_path):
  """Mixtral's `router_aux_loss_coef = 0.02` is `aux_loss_coef = 0.04` here
  (k = 2: Hugging Face's loss of a balanced router is k, meshtrain's 1; docs/moe.md)."""
  (tmp_path / "hf").mkdir()
  (tmp_path / "hf/config.json").write_text(json.dumps(MIXTRAL))
  cfg = config.get_config()
  hf_import.prepare(cfg, tmp_path / "hf", tmp_path / "run")
  assert cfg.model.moe.aux_loss_coef == pytest.approx(0.04)
  assert cfg.model.moe.bias_update_rate == 0
  note = importer.balancing_note(tmp_path / "hf", cfg.model.moe)
  assert note == ("note: MoE load balancing as the checkpoint was trained: "
                  "model.moe.aux_loss_coef=0.04 (router_aux_loss_coef 0.02 x k=2); give "
                  "--config.model.moe.* to change it")


def test_deepseek_v3_balances_as_its_report_and_preset_say():
  """The selection-bias step and the small sequence loss of DeepSeek-V3's
  report, as configs/deepseek_v3.py (written from the report) sets them."""
  preset = config.load(REPO / "configs/deepseek_v3.py").model.moe
  moe = config.get_config().model.moe
  note = hf_config.apply_balancing({"model_type": "deepseek_v3", "topk_method": "noaux_tc"}, moe)
  assert (moe.aux_loss_coef, moe.bias_update_rate) == (preset.aux_loss_coef,
                                                       preset.bias_update_rate) == (1e-4, 1e-3)
  assert "bias_update_rate=0.001 (DeepSeek-V3's report)" in note


def test_a_coefficient_the_config_sets_stays_and_the_note_says_so():
  moe = config.get_config().model.moe
  moe.aux_loss_coef = 0.5
  note = hf_config.apply_balancing(MIXTRAL, moe)
  assert moe.aux_loss_coef == 0.5
  assert "model.moe.aux_loss_coef=0.5 (router_aux_loss_coef 0.02 x k=2, the config's own; the " \
         "checkpoint's is 0.04)" in note


def test_finetune_hf_on_a_hugging_face_directory_takes_its_balancing(tmp_path):
  (tmp_path / "config.json").write_text(json.dumps({**MIXTRAL, "router_aux_loss_coef": 0.001}))
  cfg = config.load(REPO / "configs/finetune_hf.py", str(tmp_path))
  assert cfg.model.moe.aux_loss_coef == pytest.approx(0.002)


def test_a_dense_model_has_no_balancing_note():
  assert hf_config.apply_balancing({"model_type": "llama"}, config.get_config().model.moe) is None
