"""`meshtrain export-hf`: a run's weights as a Hugging Face model directory.

The family is the imported model's (`model_type` of its config), else the one
whose options the model uses (`meshtrain.hf.config.family`); a model with
options no family has (a fine-tuned import's too, such as DeepSeek-V3's
selection bias) is refused before anything is written. Experts are
written one tensor per expert, the layout `save_pretrained` writes and every
transformers version loads. Writes `config.json`, the weights as safetensors
(one `model.safetensors`, or shards of at most `max_shard_bytes` with
`model.safetensors.index.json`, as `save_pretrained` does) and the run's
tokenizer files, so that `transformers.AutoModelForCausalLM.from_pretrained(DIR)`
loads it. Weights are gathered one meshtrain tensor at a time and written one
shard at a time. `float8` writes the projection matrices as DeepSeek-V3
publishes its own (`meshtrain.hf.float8`: e4m3 values and a float32 scale per
128 x 128 block, `quantization_config`), the rest in bfloat16. DeepSeek-V3's
multi-token prediction modules (`model.mtp_layers`; no other family has
them, and a model with them exports as no other) are written as its
checkpoint holds them, copies of the embedding and head included
(`meshtrain.hf.weights`), and `num_nextn_predict_layers` counts them.
"""

import json
import math
import shutil
from collections.abc import Iterator
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
import safetensors.numpy
from jax.experimental import multihost_utils
from tqdm import tqdm

from meshtrain import workdir as saved_run
from meshtrain.data import tokenizer as tokenizers
from meshtrain.errors import ConfigError, reading
from meshtrain.hf import config as hf_config, float8
from meshtrain.hf.importer import HF_CONFIG_FILE, TOKENIZER_FILES
from meshtrain.hf.load import INDEX_FILE, SINGLE_FILE
from meshtrain.hf.weights import hf_weights, mtp_copies
from meshtrain.models.patterns import path_string

DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16,
          "float8": ml_dtypes.bfloat16}  # float8: what is not quantized


def _leaves(params, model_state, weights: dict, copies: dict) -> list[tuple[list, jax.Array]]:
  """(the HF tensors' mappings, leaf) of every weight: its own, then the
  copies of it the checkpoint keeps (`copies`: `mtp_copies`); then of the
  model state the family keeps (DeepSeek-V3's selection biases; the others
  keep none)."""
  state = jax.tree_util.tree_flatten_with_path(model_state)[0] if model_state is not None else []
  return ([([weights[path_string(path)], *copies.get(path_string(path), ())], leaf)
           for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]]
          + [([weights[path_string(path)]], leaf) for path, leaf in state
             if path_string(path) in weights])


def _hf_tensors(leaves, dtype: str) -> Iterator[list[tuple[str, np.ndarray]]]:
  """Each HF tensor in Hugging Face layout as the (name, array) pairs written
  for it (a float8 matrix: its values and its scales), one gathered meshtrain
  weight at a time."""
  for mappings, leaf in leaves:
    value = np.asarray(multihost_utils.process_allgather(leaf, tiled=True))
    for weight in mappings:
      for lead, name in weight.names(value.shape):
        tensor = weight.to_hf(value[lead])
        if dtype == "float8" and float8.quantized_on_export(name, tensor.ndim):
          values, scales = float8.quantize(tensor)
          yield [(name, values), (name + float8.SCALE_SUFFIX, scales)]
        else:
          yield [(name, tensor.astype(DTYPES[dtype]))]


def _shard_sizes(leaves, dtype: str, max_shard_bytes: int) -> list[int]:
  """How many HF tensors each shard holds, filling shards in order up to the limit."""
  sizes = []
  for mappings, leaf in leaves:
    for weight in mappings:
      names = [name for _, name in weight.names(leaf.shape)]
      inner = leaf.shape[weight.stacked_dims:]
      ndim = len(weight.hf_shape(inner))
      sizes += [math.prod(inner) * (1 if dtype == "float8" and float8.quantized_on_export(
          name, ndim) else np.dtype(DTYPES[dtype]).itemsize) for name in names]
  counts, used = [0], 0
  for size in sizes:
    if counts[-1] and used + size > max_shard_bytes:
      counts.append(0)
      used = 0
    counts[-1] += 1
    used += size
  return counts


def check_target(directory) -> None:
  directory = Path(directory)
  model = (directory / "config.json").exists() or any(directory.glob("*.safetensors"))
  saved_run.check_new_directory(directory, "--to", "a model" if model else None)


def _tokenizer_files(cfg, tokenizer: tokenizers.Tokenizer, directory: Path) -> list[str]:
  """Writes the run's tokenizer files (`tokenizer`, loaded from `cfg`) into
  `directory`; returns their names."""
  if not isinstance(tokenizer, tokenizers.HuggingFaceTokenizer):
    return []  # bytes: Hugging Face has no tokenizer file for it
  tokenizer.save(directory)
  spec = Path(cfg.tokenizer or cfg.data.path)
  origin = spec if spec.is_dir() else spec.parent
  copied = [name for name in TOKENIZER_FILES[1:] if (origin / name).is_file()]
  for name in copied:
    shutil.copyfile(origin / name, directory / name)
  if "tokenizer_config.json" not in copied:
    token = tokenizer.tokenizer.id_to_token
    special = {"eos_token": token(tokenizer.eos_id)}
    if tokenizer.bos_id is not None:
      special["bos_token"] = token(tokenizer.bos_id)
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", **special}, indent=2))
  return [tokenizers.TOKENIZER_FILE, *dict.fromkeys(["tokenizer_config.json", *copied])]


def export_hf(cfg, params, workdir, directory, *, model_state=None, dtype: str = "",
              max_shard_bytes: int = 5 * 2**30) -> list[str]:
  """Writes `params` and `model_state` (the run in `workdir` of config
  `cfg`) to `directory`; `dtype` "" keeps the imported model's dtype (else
  float32). Returns the files written."""
  directory = Path(directory)
  check_target(directory)
  source_file = Path(workdir) / HF_CONFIG_FILE
  with reading("--workdir", source_file):
    source = json.loads(source_file.read_text()) if source_file.is_file() else None
  dtype = dtype or (source or {}).get("dtype") or (source or {}).get("torch_dtype") or "float32"
  if dtype not in DTYPES:
    raise ConfigError("--dtype", f"{dtype!r} is not one of {', '.join(DTYPES)}")
  tokenizer = tokenizers.for_config(cfg)  # an unreadable one fails here, before anything is written
  # Refused here: what no family writes (a fine-tuned import's settings too).
  own_family = hf_config.family(cfg.model)
  family = (source or {}).get("model_type") or own_family
  weights = hf_weights(family, cfg.model.moe.first_dense_layers if cfg.model.moe.num_experts
                       else 0, num_layers=cfg.model.num_layers)
  leaves = _leaves(params, model_state, weights,
                   mtp_copies(cfg.model.num_layers, cfg.model.mtp_layers))
  counts = _shard_sizes(leaves, dtype, max_shard_bytes)
  names = ([SINGLE_FILE] if len(counts) == 1 else
           [f"model-{i + 1:05d}-of-{len(counts):05d}.safetensors" for i in range(len(counts))])
  writer = jax.process_index() == 0
  if writer:
    directory.mkdir(parents=True, exist_ok=True)
  tensors, weight_map, total = _hf_tensors(leaves, dtype), {}, 0
  for name, count in zip(tqdm(names, desc="export", unit="file", disable=not writer), counts):
    shard = dict(pair for _ in range(count) for pair in next(tensors))
    weight_map.update(dict.fromkeys(shard, name))
    total += sum(t.nbytes for t in shard.values())
    if writer:
      safetensors.numpy.save_file(shard, directory / name, metadata={"format": "pt"})
    del shard
  if not writer:
    return names
  if len(names) > 1:
    (directory / INDEX_FILE).write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    names.append(INDEX_FILE)
  hf = hf_config.to_hf(cfg.model, "bfloat16" if dtype == "float8" else dtype, source)
  if dtype == "float8":
    hf["quantization_config"] = float8.EXPORT_CONFIG
  if source is None:  # a model trained here: what generation needs to know
    hf.update(max_position_embeddings=cfg.seq_len, eos_token_id=tokenizer.eos_id,
              bos_token_id=tokenizer.bos_id)
  (directory / "config.json").write_text(json.dumps(hf, indent=2))
  return names + ["config.json"] + _tokenizer_files(cfg, tokenizer, directory)
