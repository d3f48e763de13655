"""The files a Hugging Face import keeps beside its step-0 checkpoint.

`meshtrain import-hf` (`meshtrain.hf_import`) writes a workdir
that `meshtrain train` continues (fine-tuning) and that `export-hf` and
`generate` read: `config.json` (the run's config with the model's shape), the
source's own config as `hf_config.json` (kept for export), its tokenizer
files, and a step-0 checkpoint in `checkpoints/`, as `train` writes them.
"""

import json
import shutil
from pathlib import Path

from meshtrain.hf import config as hf_config
from meshtrain.hf.load import layers_not_read

HF_CONFIG_FILE = "hf_config.json"  # in a workdir: the imported model's config.json
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "generation_config.json")
PREFIX = "hf:"  # config.init_from=hf:DIR


def write_files(cfg, hf: dict, source: Path, workdir: Path, has_tokenizer: bool) -> None:
  """The run's config, the source's config and its tokenizer files in `workdir`."""
  workdir.mkdir(parents=True, exist_ok=True)
  (workdir / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2))
  (workdir / HF_CONFIG_FILE).write_text(json.dumps(hf, indent=2))
  for name in TOKENIZER_FILES if has_tokenizer else ():
    if (source / name).is_file():
      shutil.copyfile(source / name, workdir / name)


def balancing_note(source: Path, moe) -> str | None:
  """The note of the MoE balancing a run of `source`'s weights uses (`moe`, its
  `config.model.moe`, which `hf_import.prepare` or the config file set); None for a
  dense model."""
  return hf_config.apply_balancing(hf_config.read(source, key="--from"), moe)


def left_out_note(source: Path, mtp_layers: int = 0) -> str | None:
  """What the import of `source` with `mtp_layers` (`config.model`'s) leaves
  out, as a note for the user: the layers beyond `num_hidden_layers` and
  those modules (DeepSeek-V3's multi-token prediction); None when it reads
  everything."""
  unread = layers_not_read(source, mtp_layers, key="--from")
  if not unread:
    return None
  return (f"note: model.layers.{', '.join(map(str, unread))}, beyond num_hidden_layers "
          f"(DeepSeek-V3's multi-token prediction), not imported: config.model.mtp_layers is "
          f"{mtp_layers}; set it to {mtp_layers + len(unread)} to import and train them (an "
          "export writes num_nextn_predict_layers = config.model.mtp_layers)")
