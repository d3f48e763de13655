"""Fine-tune a Hugging Face model: `--config configs/finetune_hf.py:SOURCE`.

SOURCE is either a workdir `meshtrain import-hf` wrote (training continues in
it from the imported step 0) or a Hugging Face model directory (a new run in
`config.workdir` starts from its weights through `config.init_from`). The
model's shape and tokenizer come from SOURCE. Give the data with
`--config.data.*`, tokenized by the model's own tokenizer.

SOURCE may be any family meshtrain imports (Llama, Mistral, Qwen2/2.5, Qwen3,
Mixtral, Qwen3-MoE; `meshtrain.hf.config`); an MoE model's experts split over
`fsdp`, so their number must divide it (or set `--config.expert_parallel=`).

Settings follow common practice for full fine-tuning of 1-8B models: a peak
learning rate ~100x below pre-training's, short warmup, no weight decay,
bfloat16 compute, and weights, gradients and optimizer state sharded over all
devices (`fsdp`), the layout that fits the most model per device.
"""

import json
from pathlib import Path

from meshtrain.config import get_config as base_config
from meshtrain.hf import config as hf_config
from meshtrain.hf.importer import HF_CONFIG_FILE, PREFIX


def get_config(source: str = ""):
  c = base_config()
  source = Path(source)
  if (source / HF_CONFIG_FILE).is_file():  # a workdir that import-hf wrote
    saved = json.loads((source / "config.json").read_text())
    c.model.update({k: v for k, v in saved["model"].items() if k in c.model})
    c.tokenizer, c.workdir = saved["tokenizer"], str(source)
  elif source.name:  # a Hugging Face model directory
    hf = hf_config.read(source, key="configs/finetune_hf.py")
    c.model.update(hf_config.model_keys(hf))
    hf_config.apply_balancing(hf, c.model.moe)  # as it was trained; train prints a note
    c.init_from = f"{PREFIX}{source}"
    if (source / "tokenizer.json").is_file():
      c.tokenizer = str(source)
  c.optimizer.learning_rate = 2e-5
  c.optimizer.warmup_steps = 50
  c.optimizer.min_lr_ratio = 0.1
  c.optimizer.weight_decay = 0.0
  c.steps = 1000
  c.global_batch = 32
  c.seq_len = 2048
  c.compute_dtype = "bfloat16"
  c.param_dtype = "bfloat16"
  c.remat = "selective"
  c.mesh.data, c.mesh.fsdp = 1, -1
  c.checkpoint.every_steps = 200
  return c
