"""`meshtrain prepare`: a corpus tokenized once into a flat token file with a document index.

Output directory (format version 1):

  tokens.bin      every document's ids back to back, each `[bos] + tokens + [eos]`
                  (`data/tokenizer.py`), little-endian uint16 when the vocabulary
                  fits, else uint32
  documents.bin   little-endian int64: where each document starts in tokens.bin,
                  then the total token count (documents + 1 entries)
  meta.json       tokenizer (a copy sits beside it as tokenizer.json unless it
                  is `bytes`), vocabulary size, EOS/BOS ids, dtype, counts, the
                  train/validation split as token ranges, and the inputs
  tokenizer.json  the Hugging Face tokenizer (absent for `bytes`)

Why a flat memmap and not ArrayRecord or Parquet: training reads windows of
`seq_len + 1` tokens that start anywhere, so the natural record is a token,
not a document. A flat array gives any window with one slice of a memmap (no
decoding, no per-record overhead, the page cache does the caching), and the
document index turns a window's positions into document ids with one
`searchsorted` for packing. Megatron (`.bin` + `.idx`) and nanoGPT
(`train.bin`) keep tokens the same way; grain reads it through the
`MapDataset` in `meshtrain.data`.

Streaming: inputs are read line by line and cut into pieces of about
`PIECE_CHARS` characters, only before a line that starts with a non-space
character, so a byte-level BPE (GPT-2, Llama 3, the BPE trained here, bytes)
encodes a piece exactly as it would the whole document; sentencepiece-style
tokenizers that prefix a space to each text see one extra space per cut, in
documents longer than a piece. Pieces are encoded in batches by the
tokenizer's own `encode_batch` (Rust threads on every core) while this thread
reads and writes the next batch, so memory stays at a few batches whatever
the corpus size. The output depends only on the inputs (sorted), the
tokenizer and the flags.

Atomic: everything is written into a hidden `.NAME.partial-*` directory beside
`--out` and renamed to `--out` when complete; on an error the partial
directory is removed. A prepared directory is checked on load
(`PreparedCorpus`): no meta.json, or files shorter than meta.json says, is
refused.
"""

import concurrent.futures
import glob
import io
import itertools
import json
import shutil
import tempfile
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from tqdm import tqdm

from meshtrain.data import tokenizer as tk
from meshtrain.errors import ConfigError

FORMAT_VERSION = 1
TOKENS_FILE = "tokens.bin"
DOCUMENTS_FILE = "documents.bin"
PIECE_CHARS = 1 << 20    # a long document is encoded in pieces of about this many characters
BATCH_CHARS = 4 << 20    # characters per encode_batch call (its encodings take tens of times that)
JSONL_SUFFIXES = (".jsonl", ".json")
PARQUET_SUFFIXES = (".parquet",)

# A piece of a document: its text, whether it starts and whether it ends the document.
Piece = tuple[str, bool, bool]


def input_files(patterns: Sequence[str]) -> list[Path]:
  """Files named by paths, globs and directories (searched recursively), in sorted order."""
  files = set()
  for pattern in patterns:
    matches = sorted(glob.glob(pattern, recursive=True)) if glob.has_magic(pattern) else [pattern]
    if not matches or not any(Path(m).exists() for m in matches):
      raise ConfigError("--input", f"{pattern!r} matches no file; give text, JSONL or Parquet "
                        "files, globs or directories")
    for match in map(Path, matches):
      if match.is_dir():
        files.update(p for p in match.rglob("*") if p.is_file() and not p.name.startswith("."))
      else:
        files.add(match)
  if not files:
    raise ConfigError("--input", f"{' '.join(patterns)} holds no files")
  return sorted(files)


def pieces(files: Sequence[Path], *, text_field: str, split_blank_lines: bool) -> Iterator[Piece]:
  """Every document of every file, as pieces."""
  for file in files:
    if file.suffix in JSONL_SUFFIXES:
      for text in _jsonl_texts(file, text_field):
        yield from _line_pieces(io.StringIO(text), split_blank_lines=False)
    elif file.suffix in PARQUET_SUFFIXES:
      for text in _parquet_texts(file, text_field):
        yield from _line_pieces(io.StringIO(text), split_blank_lines=False)
    else:
      with _open_text(file) as lines:
        yield from _line_pieces(lines, split_blank_lines=split_blank_lines)


def check_inputs(files: Sequence[Path], text_field: str) -> None:
  """The cheap checks, before anything is trained or written: each JSONL
  file's first record and each Parquet file's columns hold the text field."""
  for file in files:
    if file.suffix in JSONL_SUFFIXES:
      next(_jsonl_texts(file, text_field), None)
    elif file.suffix in PARQUET_SUFFIXES:
      next(_parquet_texts(file, text_field), None)


def _open_text(file: Path):
  try:
    return open(file, encoding="utf-8", newline="")
  except OSError as error:
    raise ConfigError("--input", f"cannot read {file} ({error.strerror})") from None


def _line_pieces(lines: Iterable[str], *, split_blank_lines: bool) -> Iterator[Piece]:
  """Lines joined into pieces of about PIECE_CHARS; with `split_blank_lines`
  every run of blank lines ends a document, else all lines are one document.
  Documents of only whitespace are dropped."""
  buffer, size, starts = [], 0, True

  def flush(ends: bool) -> Iterator[Piece]:
    text = "".join(buffer)
    if not (starts and ends and not text.strip()):
      yield text, starts, ends

  try:
    for line in lines:
      if split_blank_lines and not line.strip():
        if buffer:
          yield from flush(True)
          buffer, size, starts = [], 0, True
        continue
      if size >= PIECE_CHARS and line[:1].strip():
        yield from flush(False)
        buffer, size, starts = [], 0, False
      buffer.append(line)
      size += len(line)
  except UnicodeDecodeError as error:
    raise ConfigError("--input", f"{getattr(lines, 'name', 'a file')} is not UTF-8 text "
                      f"({error.reason} at byte {error.start})") from None
  if buffer:
    yield from flush(True)


def _jsonl_texts(file: Path, field: str) -> Iterator[str]:
  with _open_text(file) as lines:
    for number, line in enumerate(lines, 1):
      if not line.strip():
        continue
      try:
        text = json.loads(line)[field]
      except (ValueError, TypeError) as error:
        raise ConfigError("--input", f"{file} line {number} is not a JSON object ({error})") from None
      except KeyError:
        raise ConfigError("--text_field", f"{file} line {number} has no field {field!r}; set "
                          "--text_field to the field that holds the text") from None
      if not isinstance(text, str):
        raise ConfigError("--text_field", f"{file} line {number}: field {field!r} holds "
                          f"{type(text).__name__}, not text")
      yield text


def _parquet_texts(file: Path, field: str) -> Iterator[str]:
  try:
    table = pq.ParquetFile(file)
  except (OSError, pa.ArrowException) as error:
    raise ConfigError("--input", f"{file} is not a Parquet file ({error})") from None
  if field not in table.schema_arrow.names:
    raise ConfigError("--text_field", f"{file} has no column {field!r} (columns: "
                      f"{', '.join(table.schema_arrow.names)}); set --text_field to the text column")
  for batch in table.iter_batches(batch_size=1024, columns=[field]):
    yield from (text for text in batch.column(0).to_pylist() if text)


def _batches(stream: Iterable[Piece]) -> Iterator[list[Piece]]:
  batch, size = [], 0
  for piece in stream:
    batch.append(piece)
    size += len(piece[0])
    if size >= BATCH_CHARS:
      yield batch
      batch, size = [], 0
  if batch:
    yield batch


def token_dtype(vocab_size: int) -> np.dtype:
  return np.dtype("<u2") if vocab_size <= 1 << 16 else np.dtype("<u4")


def prepare(inputs: Sequence[str], tokenizer_spec: str, out: str, *, text_field: str = "text",
            split_blank_lines: bool = False, val_fraction: float = 0.05) -> dict:
  """Tokenizes `inputs` into the directory `out` (module docstring); returns its meta."""
  out_dir = Path(out)
  if out_dir.exists():
    raise ConfigError("--out", f"{out} already exists; remove it or choose another directory")
  if not 0 <= val_fraction < 1:
    raise ConfigError("--val_fraction", f"is {val_fraction}; use a share in [0, 1)")
  files = input_files(inputs)
  check_inputs(files, text_field)

  def stream() -> Iterator[Piece]:
    return pieces(files, text_field=text_field, split_blank_lines=split_blank_lines)

  total_bytes = sum(f.stat().st_size for f in files)
  tokenizer = _tokenizer(tokenizer_spec, stream, total_bytes)
  created = _first_missing(out_dir.absolute().parent)
  out_dir.absolute().parent.mkdir(parents=True, exist_ok=True)
  partial = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.partial-", dir=out_dir.absolute().parent))
  partial.chmod(0o755)  # mkdtemp makes it private
  try:
    counts = _write_tokens(stream(), tokenizer, partial, total_bytes)
    if not counts["documents"]:
      raise ConfigError("--input", f"{' '.join(inputs)} holds no text")
    split = _split(partial / DOCUMENTS_FILE, counts["tokens"], val_fraction)
    meta = {"format": FORMAT_VERSION, "tokenizer": tokenizer.spec, "vocab_size": tokenizer.vocab_size,
            "eos_id": tokenizer.eos_id, "bos_id": tokenizer.bos_id,
            "dtype": token_dtype(tokenizer.vocab_size).name, **counts, "split": split,
            "inputs": [str(f) for f in files], "text_field": text_field,
            "split_blank_lines": split_blank_lines, "tokenizer_source": tokenizer_spec}
    tokenizer.save(partial)
    (partial / tk.META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    partial.rename(out_dir)
  except BaseException:
    shutil.rmtree(created or partial, ignore_errors=True)
    raise
  return meta


def _first_missing(directory: Path) -> Path | None:
  """The outermost ancestor of `directory` (or itself) that does not exist yet."""
  missing = None
  for path in (directory, *directory.parents):
    if path.exists():
      return missing
    missing = path
  return missing


def _tokenizer(spec: str, stream, total_bytes: int) -> tk.Tokenizer:
  if not spec.startswith("train:"):
    return tk.load(spec, key="--tokenizer")
  size = spec.removeprefix("train:")
  if not size.isdigit():
    raise ConfigError("--tokenizer", f"{spec!r}: give the vocabulary size as train:N, e.g. train:1024")
  with tqdm(total=total_bytes, unit="B", unit_scale=True, desc="train BPE") as bar:
    def texts() -> Iterator[str]:
      for text, _, _ in stream():
        bar.update(len(text.encode("utf-8")))
        yield text
    return tk.train_bpe(texts(), int(size), key="--tokenizer")


def _write_tokens(stream: Iterable[Piece], tokenizer: tk.Tokenizer, directory: Path,
                  total_bytes: int) -> dict:
  """Encodes batch k+1 (Rust threads, GIL released) while writing batch k."""
  dtype = token_dtype(tokenizer.vocab_size)
  tokens = documents = 0
  start = time.perf_counter()
  with (open(directory / TOKENS_FILE, "wb") as tokens_out,
        open(directory / DOCUMENTS_FILE, "wb") as documents_out,
        concurrent.futures.ThreadPoolExecutor(1) as encoder,
        tqdm(total=total_bytes, unit="B", unit_scale=True, desc="prepare") as bar):

    def encode(batch: list[Piece]):
      texts, starts, ends = zip(*batch)
      return tk.document_ids(tokenizer, texts, starts=starts, ends=ends), starts, \
          sum(len(t.encode("utf-8")) for t in texts)

    pending = None
    for batch in itertools.chain(_batches(stream), [None]):
      done, pending = pending, encoder.submit(encode, batch) if batch else None
      if done is None:
        continue
      ids, starts, size = done.result()
      lengths = np.fromiter(map(len, ids), np.int64, len(ids))
      offsets = tokens + np.concatenate([[0], np.cumsum(lengths)[:-1]])
      documents_out.write(offsets[np.asarray(starts)].astype("<i8").tobytes())
      tokens_out.write(np.concatenate(ids).astype(dtype).tobytes())
      tokens += int(lengths.sum())
      documents += int(np.sum(starts))
      bar.update(size)
      bar.set_postfix(tok_s=f"{tokens / (time.perf_counter() - start):,.0f}")
    documents_out.write(np.array([tokens], "<i8").tobytes())
  return {"documents": documents, "tokens": tokens}


def _split(documents_file: Path, num_tokens: int, val_fraction: float) -> dict:
  """Token ranges of the train and validation splits: the last `val_fraction`
  of the tokens, cut at the nearest document start when one lies within half
  the validation size of the target (no document in both splits), else inside
  a document (a corpus of a few long documents, such as one book)."""
  target = num_tokens - round(val_fraction * num_tokens)
  cut = target
  if 0 < target < num_tokens:
    starts = np.fromfile(documents_file, "<i8")[1:-1]
    if len(starts):
      nearest = int(starts[np.argmin(np.abs(starts - target))])
      if abs(nearest - target) <= (num_tokens - target) / 2:
        cut = nearest
  return {"train": [0, cut], "val": [cut, num_tokens]}
