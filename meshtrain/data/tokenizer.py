"""Tokenizers: byte-level, any Hugging Face `tokenizer.json`, or a BPE trained here.

Every tokenizer turns a document into `[bos] + tokens + [eos]` ids (`bos` only
where the tokenizer has one, as Llama's do) and decodes ids back to text. A
prepared corpus keeps a copy of its tokenizer (`save`), so a run, its
evaluation and its samples all read text through the same one (`load` of the
prepared directory).

Specs (`meshtrain prepare --tokenizer`, `load`):
  bytes              one id per UTF-8 byte (vocabulary 256); the NUL byte,
                     which text does not contain, ends a document
  PATH/tokenizer.json a Hugging Face tokenizer (Llama, GPT-2, Mistral, ...), or
  DIR                a prepared corpus (its `meta.json` names its tokenizer and
                     the ids that end and start a document), or a directory
                     holding a tokenizer.json (a Hugging Face model)
  train:N            (prepare only) a byte-level BPE of N ids trained on the input
"""

import functools
import json
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np
import tokenizers

from meshtrain.errors import ConfigError

TOKENIZER_FILE = "tokenizer.json"
META_FILE = "meta.json"  # a prepared corpus: {"tokenizer": "bytes" | "tokenizer.json", "eos_id", "bos_id", ...}
# Special tokens that end or start a document, by the conventions of the
# tokenizer families in use (Llama 3, GPT-2/NeoX, Llama 2/Mistral, Gemma).
EOS_NAMES = ("<|end_of_text|>", "<|endoftext|>", "</s>", "<eos>")
BOS_NAMES = ("<|begin_of_text|>", "<s>", "<bos>")
# Beside a tokenizer.json, where its special tokens are named, first found first.
TOKENIZER_CONFIGS = ("tokenizer_config.json", "special_tokens_map.json")
TRAINED_EOS = "<|endoftext|>"
MAX_VOCAB = 2**32  # ids a prepared corpus can hold (uint32)


class ByteTokenizer:
  """UTF-8 bytes as ids; id 0 (NUL) ends a document."""

  spec = "bytes"
  vocab_size = 256
  eos_id = 0
  bos_id = None

  def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
    return [np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int64) for text in texts]

  def decode(self, ids: Iterable[int]) -> str:
    return bytes(int(i) for i in ids if 0 < int(i) < 256).decode("utf-8", errors="replace")

  def save(self, directory: Path) -> None:
    del directory  # nothing to keep: the spec says it all


class HuggingFaceTokenizer:
  """A `tokenizers.Tokenizer` with the ids that end and start a document."""

  spec = TOKENIZER_FILE

  def __init__(self, tokenizer: tokenizers.Tokenizer, eos_id: int, bos_id: int | None):
    self.tokenizer, self.eos_id, self.bos_id = tokenizer, eos_id, bos_id
    self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)

  def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
    encodings = self.tokenizer.encode_batch_fast(list(texts), add_special_tokens=False)
    return [np.asarray(e.ids, np.int64) for e in encodings]

  def decode(self, ids: Iterable[int]) -> str:
    return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=True)

  def save(self, directory: Path) -> None:
    self.tokenizer.save(str(Path(directory) / TOKENIZER_FILE))


Tokenizer = ByteTokenizer | HuggingFaceTokenizer


def document_ids(tokenizer: Tokenizer, texts: Sequence[str], *,
                 starts: Sequence[bool] | None = None,
                 ends: Sequence[bool] | None = None) -> list[np.ndarray]:
  """Each text as `[bos] + tokens + [eos]`; where a text is a piece of a
  document, `starts[i]` / `ends[i]` say whether it takes the bos / the eos."""
  starts = [True] * len(texts) if starts is None else starts
  ends = [True] * len(texts) if ends is None else ends
  head = [] if tokenizer.bos_id is None else [tokenizer.bos_id]
  return [np.concatenate([head if start else [], ids, [tokenizer.eos_id] if end else []])
          .astype(np.int64) for ids, start, end in zip(tokenizer.encode_batch(texts), starts, ends)]


def load(spec: str, *, key: str) -> Tokenizer:
  """The tokenizer `spec` names (module docstring); `key` is the flag or config
  key that gave it, for the error message. A load is kept while the files it
  reads stay as they were (resolved path, inode, size, modification time), so
  a command that checks a tokenizer at start-up and uses it later reads it
  once: the tokenizer returned is shared, to be used and not changed."""
  if spec == "bytes":
    return ByteTokenizer()
  try:
    return _load(spec, _files_read(Path(spec)))
  except ConfigError as error:  # raised under `_LOADED`, told under `key`
    raise ConfigError(key, error.message) from None


def _files_read(path: Path) -> tuple[tuple[Path, tuple[int, int, int] | None], ...]:
  """The files a load of `path` reads, resolved, each with its inode, size and
  modification time in ns (None where it is absent or cannot be read)."""
  folder, file = (path, path / TOKENIZER_FILE) if path.is_dir() else (path.parent, path)
  return tuple((f.resolve(), _identity(f)) for f in (
      path / META_FILE, file, *(folder / name for name in TOKENIZER_CONFIGS)))


def _identity(file: Path) -> tuple[int, int, int] | None:
  try:
    status = file.stat()
  except OSError:
    return None
  return status.st_ino, status.st_size, status.st_mtime_ns


_LOADED = "tokenizer"  # the key `_load` raises under, for `load` to replace


@functools.lru_cache(maxsize=8)
def _load(spec: str, files_read: tuple) -> Tokenizer:
  """`load` of a path; `files_read` (`_files_read`) is only the cache's key."""
  del files_read
  path, key = Path(spec), _LOADED
  meta = _prepared_meta(path, key)
  if meta.get("tokenizer") == "bytes":
    return ByteTokenizer()
  file = path / TOKENIZER_FILE if path.is_dir() else path
  if not file.is_file():
    raise ConfigError(key, f"{spec!r} is neither 'bytes', 'train:N' nor a tokenizer.json file "
                      "(or a directory holding one)")
  try:
    tokenizer = tokenizers.Tokenizer.from_file(str(file))
  except Exception as error:  # the Rust side raises a bare Exception on bad JSON
    reason = str(error).splitlines()[0] if str(error) else type(error).__name__
    raise ConfigError(key, f"{file} is not a Hugging Face tokenizer.json ({reason})") from None
  if meta:
    return HuggingFaceTokenizer(tokenizer, meta["eos_id"], meta.get("bos_id"))
  config = _tokenizer_config(file.parent)
  eos = _special_id(tokenizer, config.get("eos_token"), EOS_NAMES)
  if eos is None:
    raise ConfigError(key, f"{file} has no end-of-document token (none of {', '.join(EOS_NAMES)}, "
                      "and no eos_token in a tokenizer_config.json beside it); add one there")
  return HuggingFaceTokenizer(tokenizer, eos, _special_id(tokenizer, config.get("bos_token"),
                                                          BOS_NAMES))


def train_bpe(texts: Iterable[str], vocab_size: int, *, key: str) -> HuggingFaceTokenizer:
  """A byte-level BPE of `vocab_size` ids (GPT-2's scheme) trained on `texts`."""
  alphabet = tokenizers.pre_tokenizers.ByteLevel.alphabet()
  if vocab_size < len(alphabet) + 1:
    raise ConfigError(key, f"train:{vocab_size} is too small; a byte-level BPE needs at least "
                      f"{len(alphabet) + 1} ids (the 256 bytes and the end-of-document token)")
  if vocab_size > MAX_VOCAB:
    raise ConfigError(key, f"train:{vocab_size} is too large; a prepared corpus holds ids as "
                      f"uint32, so give {MAX_VOCAB} or fewer")
  tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE())
  tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
  tokenizer.decoder = tokenizers.decoders.ByteLevel()
  trainer = tokenizers.trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[TRAINED_EOS],
                                           initial_alphabet=alphabet, show_progress=False)
  tokenizer.train_from_iterator(texts, trainer=trainer)
  return HuggingFaceTokenizer(tokenizer, tokenizer.token_to_id(TRAINED_EOS), None)


def _prepared_meta(path: Path, key: str) -> dict:
  """A prepared corpus's `meta.json`, or {} where `path` is not one."""
  file = path / META_FILE
  if not file.is_file():
    return {}
  try:
    meta = json.loads(file.read_text())
    if meta["tokenizer"] not in ("bytes", TOKENIZER_FILE) or not isinstance(meta["eos_id"], int):
      raise ValueError(f"tokenizer {meta['tokenizer']!r}, eos_id {meta['eos_id']!r}")
  except (OSError, ValueError, KeyError, TypeError, RecursionError) as error:
    raise ConfigError(key, f"{file} is unreadable or incomplete ({error}); prepare the corpus "
                      "again with `meshtrain prepare`") from None
  return meta


def _tokenizer_config(directory: Path) -> dict:
  """`tokenizer_config.json` (or `special_tokens_map.json`) beside the tokenizer, if any."""
  for name in TOKENIZER_CONFIGS:
    try:
      config = json.loads((directory / name).read_text())
    except (OSError, ValueError, RecursionError):
      continue
    if isinstance(config, dict):  # else as unreadable as broken JSON
      return config
  return {}


def _special_id(tokenizer: tokenizers.Tokenizer, configured, names: Sequence[str]) -> int | None:
  """The id of the configured special token, else of the first known name present."""
  if isinstance(configured, dict):
    configured = configured.get("content")
  for name in ([configured] if configured else []) + list(names):
    token_id = tokenizer.token_to_id(name)
    if token_id is not None:
      return token_id
  return None


def for_config(cfg) -> Tokenizer:
  """The run's tokenizer: `config.tokenizer` if set, else its data's (a prepared
  corpus keeps its own; byte-level text and the synthetic task use bytes)."""
  if cfg.tokenizer:
    return load(cfg.tokenizer, key="config.tokenizer")
  if cfg.data.source == "tokens":
    return load(cfg.data.path, key="config.data.path")
  return ByteTokenizer()
