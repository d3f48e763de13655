"""Hugging Face weights (each family of `meshtrain.hf.config`) straight into their shards.

Each device's block of each weight is read from the safetensors files on its
own (`safe_open` + `get_slice`: only the rows and columns it covers), converted
to float32 and put on that device before the next is read, so the host holds
at most one block beyond what the devices hold, and a process reads only what
its own devices hold. A file is opened per read: its memory map (resident
pages count as the process's memory) is let go at once. Float8 matrices (a
checkpoint's `quantization_config`, `meshtrain.hf.float8`) are read as their
bytes and multiplied by their block scales, each block as it is read.
"""

import contextlib
import itertools
import json
import math
from pathlib import Path

import jax
import numpy as np
from safetensors import SafetensorError, safe_open
from tqdm import tqdm

from meshtrain.errors import ConfigError, reading
from meshtrain.hf import config as hf_config, float8
from meshtrain.hf.weights import FUSED_GATE_UP, hf_weights
from meshtrain.models.patterns import path_string

INDEX_FILE = "model.safetensors.index.json"
READ_BYTES = 64 * 2**20  # of a tensor's file bytes mapped at once
_ITEMSIZE = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2, "I64": 8, "I32": 4, "I8": 1, "U8": 1,
             **dict.fromkeys(float8.RAW_DTYPES, 1)}
SINGLE_FILE = "model.safetensors"


class SafetensorsDir:
  """The tensors of a Hugging Face model directory: which file holds each."""

  def __init__(self, directory, *, key: str, block: tuple[int, int] | None = None):
    """`block`: the quantized matrices' scale block (`float8.block_size`)."""
    self.directory, self.key, self.block = Path(directory), key, block
    self._headers: dict[Path, tuple[int, dict]] = {}
    index = self.directory / INDEX_FILE
    if index.is_file():
      with reading(key, index):
        text = index.read_text()
      try:
        weight_map = json.loads(text)["weight_map"]
      except (ValueError, KeyError, TypeError, RecursionError) as error:
        raise ConfigError(key, f"{index} is not a safetensors index ({error})") from None
    elif (self.directory / SINGLE_FILE).is_file():
      weight_map = dict.fromkeys(self._keys(self.directory / SINGLE_FILE), SINGLE_FILE)
    else:
      raise ConfigError(key, f"{self.directory} has neither {SINGLE_FILE} nor {INDEX_FILE}")
    missing = sorted({f for f in weight_map.values() if not (self.directory / f).is_file()})
    if missing:
      raise ConfigError(key, f"{self.directory / missing[0]} is missing (named in {INDEX_FILE}); "
                        "download every shard of the model")
    self.files = {name: self.directory / file for name, file in weight_map.items()}

  @contextlib.contextmanager
  def _open(self, file: Path):
    """`safe_open(file)`; a file that is not safetensors is one line naming the flag."""
    try:
      with reading(self.key, file), safe_open(file, "numpy") as f:
        yield f
    except SafetensorError as error:
      raise ConfigError(self.key, f"{file} is not a safetensors file ({error}); download it "
                        "again") from None

  def _keys(self, file: Path) -> list[str]:
    with self._open(file) as f:
      return list(f.keys())

  def _info(self, name: str) -> tuple[tuple[int, ...], str]:
    """(shape, safetensors dtype) of a tensor."""
    if name not in self.files:
      raise ConfigError(self.key, f"{self.directory} has no tensor {name}")
    with self._open(self.files[name]) as f:
      tensor = f.get_slice(name)
      return tuple(tensor.get_shape()), tensor.get_dtype()

  def shape(self, name: str) -> tuple[int, ...]:
    return self._info(name)[0]

  def _raw(self, name: str, index: tuple[slice, ...]) -> np.ndarray:
    """tensor[index] of a dtype numpy lacks (float8), through a memory map of
    its bytes where the file's header (safetensors' format: its size in 8
    bytes, then JSON) places them."""
    file = self.files[name]
    with reading(self.key, file):
      if file not in self._headers:
        with open(file, "rb") as f:
          size = int.from_bytes(f.read(8), "little")
          self._headers[file] = (8 + size, json.loads(f.read(size)))
      start, header = self._headers[file]
      entry = header[name]
      values = np.memmap(file, float8.RAW_DTYPES[entry["dtype"]], "r",
                         offset=start + entry["data_offsets"][0], shape=tuple(entry["shape"]))
      return np.array(values[index])

  def check_scales(self, name: str) -> str | None:
    """The name of a float8 tensor's scales, checked against its shape; None
    for a tensor that is not quantized."""
    shape, dtype = self._info(name)
    if dtype not in float8.QUANTIZED:
      return None
    scale_name = name + float8.SCALE_SUFFIX
    if scale_name not in self.files:
      raise ConfigError(self.key, f"tensor {name} is float8 but {self.directory} has no "
                        f"{scale_name}; download every shard of the model")
    (scales, scale_dtype), grid = self._info(scale_name), float8.grid_shape(shape, self.block)
    if scale_dtype in float8.QUANTIZED:
      raise ConfigError(self.key, f"tensor {scale_name} is {scale_dtype}; block scales are "
                        "float32, bfloat16 or UE8M0 (F8_E8M0, U8)")
    if scales != grid and not (grid is None and math.prod(scales) == 1):
      raise ConfigError(self.key, f"tensor {scale_name} is {list(scales)}, but {name} "
                        f"{list(shape)} in blocks of quantization_config.weight_block_size="
                        f"{list(self.block or [])} has {list(grid or [1])} scales")
    return scale_name

  def _dequantized(self, name: str, index: tuple[slice, ...]) -> np.ndarray:
    """tensor[index]; a float8 matrix times its block scales, in float32."""
    shape, dtype = self._info(name)
    if dtype not in float8.RAW_DTYPES:
      with self._open(self.files[name]) as f:
        return f.get_slice(name)[index]
    values = self._raw(name, index)
    if dtype not in float8.QUANTIZED:
      return values
    scale_name = self.check_scales(name)
    scales = float8.scale_values(self._dequantized(scale_name, ()))
    if not np.isfinite(scales).all():
      raise ConfigError(self.key, f"tensor {scale_name} holds scales that are not finite; "
                        "download the shard again")
    return float8.dequantize(values, scales, self.block, shape, index)

  def read(self, name: str, index: tuple[slice, ...]) -> np.ndarray:
    """tensor[index], read in runs of rows of at most READ_BYTES of the file,
    each through its own memory map."""
    shape, dtype = self._info(name)
    if len(shape) == 1:
      return self._dequantized(name, index)
    first, stop, _ = index[0].indices(shape[0])
    row_bytes = math.prod(shape[1:]) * _ITEMSIZE.get(dtype, 4)
    step = max(1, READ_BYTES // row_bytes)
    out = None
    for start in range(first, stop, step):
      rows = self._dequantized(name, (slice(start, min(start + step, stop)), *index[1:]))
      if out is None:
        out = np.empty((stop - first, *rows.shape[1:]), rows.dtype)
      out[start - first:start - first + len(rows)] = rows
    return out


def _tensors(directory, key: str) -> tuple[SafetensorsDir, dict]:
  """The model's tensors, and its family's names for them in the expert
  layout the directory holds."""
  hf = hf_config.read(directory, key=key)
  tensors = SafetensorsDir(directory, key=key, block=float8.block_size(hf))
  dense = hf_config.model_keys(hf)["moe"].get("first_dense_layers", 0)
  fused = f"model.layers.{dense}.{FUSED_GATE_UP}" in tensors.files
  return tensors, hf_weights(hf["model_type"], dense, fused_experts=fused,
                             num_layers=hf["num_hidden_layers"])


def _check_shapes(tensors: SafetensorsDir, weights: dict, abstract_params) -> None:
  """Every tensor meshtrain needs is there with the shape config.json implies
  (a float8 one with its scales)."""
  for path, leaf in jax.tree_util.tree_flatten_with_path(abstract_params)[0]:
    weight = weights[path_string(path)]
    expected = weight.hf_shape(leaf.shape[weight.stacked_dims:])
    for _, name in weight.names(leaf.shape):
      if tensors.shape(name) != expected:
        raise ConfigError(tensors.key, f"tensor {name} is {list(tensors.shape(name))} in "
                          f"{tensors.directory} but its config.json implies {list(expected)}")
      tensors.check_scales(name)


def _block(tensors: SafetensorsDir, weight, shape, index, dtype) -> np.ndarray:
  """meshtrain's weight[index] (a device's block) read from the HF tensors:
  one read per HF tensor (layer, expert) the block covers."""
  stacked = weight.stacked_dims
  ranges = [range(*i.indices(n)) for i, n in zip(index[:stacked], shape[:stacked])]
  names = dict(weight.names(shape))
  block = None
  for lead in itertools.product(*ranges):
    name = names[lead]
    one = weight.read(lambda i: tensors.read(name, i), shape[stacked:], index[stacked:])
    if block is None:
      block = np.empty((*map(len, ranges), *one.shape), dtype)
    block[tuple(i - r.start for i, r in zip(lead, ranges))] = one
  return block


def _place(tensors: SafetensorsDir, weight, abstract, sharding) -> jax.Array:
  """One weight on the mesh, block by block; devices holding the same block share one read."""
  by_index: dict[tuple, list] = {}
  for device, index in sharding.addressable_devices_indices_map(abstract.shape).items():
    by_index.setdefault(tuple((s.start, s.stop) for s in index), []).append((device, index))
  arrays = []
  for devices in by_index.values():
    block = _block(tensors, weight, abstract.shape, devices[0][1], abstract.dtype)
    arrays += [jax.device_put(block, device) for device, _ in devices]
    del block
  return jax.make_array_from_single_device_arrays(abstract.shape, sharding, arrays)


def load_params(directory, abstract_params, shardings, *, key: str):
  """The weights of the Hugging Face model in `directory` as meshtrain's
  parameters (`abstract_params` tree), laid out by `shardings`."""
  tensors, weights = _tensors(directory, key)
  return _load(tensors, weights, abstract_params, shardings)


def load_model_state(directory, abstract_state, shardings, *, key: str):
  """The model state the Hugging Face model in `directory` keeps (DeepSeek-V3's
  router selection biases), laid out by `shardings`; None where its family
  keeps none (the state then starts at zero)."""
  tensors, weights = _tensors(directory, key)
  paths = [path_string(path) for path, _ in jax.tree_util.tree_flatten_with_path(abstract_state)[0]]
  if not paths or any(path not in weights for path in paths):
    return None
  return _load(tensors, weights, abstract_state, shardings)


def _load(tensors: SafetensorsDir, weights: dict, abstract, shardings):
  _check_shapes(tensors, weights, abstract)
  leaves, treedef = jax.tree_util.tree_flatten_with_path(abstract)
  flat_shardings = jax.tree.leaves(shardings)
  placed = [_place(tensors, weights[path_string(path)], leaf, sharding)
            for (path, leaf), sharding in tqdm(list(zip(leaves, flat_shardings)), desc="import",
                                               unit="tensor", disable=jax.process_index() != 0)]
  return jax.tree_util.tree_unflatten(treedef, placed)


def _layers_from(directory, first: int, key: str) -> list[int]:
  """The layers numbered `first` on whose tensors the checkpoint in `directory` holds."""
  prefix = "model.layers."
  layers = {name[len(prefix):].split(".", 1)[0] for name in SafetensorsDir(directory, key=key).files
            if name.startswith(prefix)}
  return sorted(int(layer) for layer in layers if layer.isdigit() and int(layer) >= first)


def layers_not_read(directory, mtp_layers: int = 0, *, key: str) -> list[int]:
  """The layers the checkpoint in `directory` holds beyond its
  `num_hidden_layers` and the `mtp_layers` multi-token prediction modules
  imported after them, which the import leaves out: DeepSeek-V3's modules
  (`model.layers.61`) that `config.model.mtp_layers` does not ask for."""
  return _layers_from(directory, hf_config.read(directory, key=key)["num_hidden_layers"]
                      + mtp_layers, key)


def check_mtp_layers(directory, hf: dict, mtp_layers: int) -> None:
  """`config.model.mtp_layers` asks for no more multi-token prediction modules
  than the checkpoint in `directory` (config.json `hf`) holds: as many as its
  config.json counts (`num_nextn_predict_layers`) and, where its weights are
  there, its files have tensors of (transformers' `save_pretrained` writes
  none, whatever its config says)."""
  if not mtp_layers:
    return
  first, counted = hf["num_hidden_layers"], hf_config.mtp_layers(hf)
  held = counted
  if any((Path(directory) / name).is_file() for name in (INDEX_FILE, SINGLE_FILE)):
    saved = set(_layers_from(directory, first, "--from"))
    held = next((k for k in range(counted) if first + k not in saved), counted)
  if mtp_layers > held:
    held_text = (f"holds the tensors of {held} multi-token prediction modules (model.layers."
                 f"{first} on), though its config.json counts {counted} "
                 "(num_nextn_predict_layers; transformers' save_pretrained writes none)"
                 if held < counted else
                 f"has {held} multi-token prediction modules (num_nextn_predict_layers)")
    raise ConfigError("config.model.mtp_layers", f"is {mtp_layers} but the model in {directory} "
                      f"{held_text}; set it to {held}" + (" or less" if held else ""))


def check_model(directory, model_cfg, *, key: str) -> dict:
  """DIR's config.json, checked against `config.model` (which must describe the
  same model, with at most as many multi-token prediction modules)."""
  hf = hf_config.read(directory, key=key)
  keys = hf_config.model_keys(hf)
  flat = {}
  for field, value in keys.items():  # model.moe and model.mla nested
    flat.update({f"{field}.{k}": v for k, v in value.items()} if isinstance(value, dict)
                else {field: value})
  for name, value in flat.items():
    section, _, inner = name.rpartition(".")
    mine = (model_cfg[section] if section else model_cfg)[inner]
    if mine != value:
      raise ConfigError(f"config.model.{name}", f"is {mine!r} but the model in "
                        f"{directory} has {value!r}; set it to {value!r}")
  check_mtp_layers(directory, hf, model_cfg.mtp_layers)
  return hf
