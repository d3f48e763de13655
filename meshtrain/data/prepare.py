"""`meshtrain prepare`: a corpus tokenized once into a flat token file with a document index.

Output directory (format version 2; version 1, the same without loss_mask.bin
and its entry in meta.json, still loads):

  tokens.bin      every document's ids back to back, each `[bos] + tokens + [eos]`
                  (`data/tokenizer.py`), or for `--format chat` each conversation
                  as its chat template renders it (`data/chat.py`),
                  little-endian uint16 when the vocabulary fits, else uint32
  documents.bin   little-endian int64: where each document starts in tokens.bin,
                  then the total token count (documents + 1 entries)
  loss_mask.bin   (`--format chat` only) one uint8 per token of tokens.bin: 1
                  where the token counts in the loss (an assistant turn's), else 0
  meta.json       tokenizer (a copy sits beside it as tokenizer.json unless it
                  is `bytes`), vocabulary size, EOS/BOS ids, dtype, counts, the
                  train/validation split as token ranges, the inputs, their
                  format (`input_format`) and whether loss_mask.bin is there
                  (`loss_mask`)
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
the corpus size. Conversations are rendered in Python (jinja2) and encoded
in the same batches. The output depends only on the inputs (sorted), the
tokenizer and the flags.

Atomic: everything is written into a hidden `.NAME.partial-*` directory beside
`--out` and renamed to `--out` when complete; on an error the partial
directory is removed. A prepared directory is checked on load
(`PreparedCorpus`): no meta.json, or files shorter than meta.json says, is
refused.
"""

import concurrent.futures
import contextlib
import functools
import glob
import io
import itertools
import json
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from tqdm import tqdm

from meshtrain.data import chat
from meshtrain.data import tokenizer as tk
from meshtrain.errors import ConfigError, reading

FORMAT_VERSION = 2
READABLE_FORMATS = (1, 2)  # 1: no loss mask
INPUT_FORMATS = ("text", "chat")
TOKENS_FILE = "tokens.bin"
DOCUMENTS_FILE = "documents.bin"
LOSS_MASK_FILE = "loss_mask.bin"
PIECE_CHARS = 1 << 20    # a long document is encoded in pieces of about this many characters
BATCH_CHARS = 4 << 20    # characters per encode_batch call (its encodings take tens of times that)
JSONL_SUFFIXES = (".jsonl", ".json")
PARQUET_SUFFIXES = (".parquet",)
TEXT_FIELD = "text"  # the JSONL field / Parquet column read unless `prepare` is told another

# A piece of a document: its text, whether it starts and whether it ends the document.
Piece = tuple[str, bool, bool]
Item = TypeVar("Item")  # what a batch holds: pieces or conversations


class Encoded(NamedTuple):
  """A batch of documents or pieces of them, encoded."""

  ids: list[np.ndarray]
  starts: Sequence[bool]          # whether each opens a document
  masks: list[np.ndarray] | None  # each one's loss mask (None: every token counts)
  size: int                       # the input bytes they came from, for the progress bar


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
      with reading("--input", file), _open_text(file) as lines:
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
  return open(file, encoding="utf-8", newline="")  # inside `reading("--input", file)`


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


def _jsonl_records(file: Path) -> Iterator[tuple[int, Any, int]]:
  """Each non-blank line's number, JSON value and size in bytes."""
  with reading("--input", file), _open_text(file) as lines:
    try:
      for number, line in enumerate(lines, 1):
        if not line.strip():
          continue
        try:
          record = json.loads(line)
        except (ValueError, RecursionError) as error:  # nested too deep: RecursionError
          raise ConfigError("--input", f"{file} line {number} is not JSON ({error}); give one "
                            "JSON object a line") from None
        _check_surrogates(record, line, f"{file} line {number}")
        yield number, record, len(line.encode("utf-8"))
    except UnicodeDecodeError as error:
      raise ConfigError("--input", f"{file} is not UTF-8 text ({error.reason} at byte "
                        f"{error.start})") from None


def _check_surrogates(record: Any, line: str, where: str) -> None:
  """Refuses a line that escapes half of a UTF-16 surrogate pair (`"\\ud800"`):
  valid JSON, but no text that a tokenizer can encode."""
  if re.search(r"\\u[dD][89a-fA-F]", line):
    try:
      json.dumps(record, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as error:
      raise ConfigError("--input", f"{where} holds {error.object[error.start]!r}, half of a "
                        "UTF-16 surrogate pair, which is no character; fix its \\u escapes"
                        ) from None


def _jsonl_texts(file: Path, field: str) -> Iterator[str]:
  for number, record, _ in _jsonl_records(file):
    if not isinstance(record, dict):
      raise ConfigError("--input", f"{file} line {number} is not a JSON object")
    if field not in record:
      raise ConfigError("--text_field", f"{file} line {number} has no field {field!r}; set "
                        "--text_field to the field that holds the text")
    text = record[field]
    if not isinstance(text, str):
      raise ConfigError("--text_field", f"{file} line {number}: field {field!r} holds "
                        f"{type(text).__name__}, not text")
    yield text


def conversations(files: Sequence[Path]) -> Iterator[chat.Conversation]:
  """Every conversation of every JSONL file (`data/chat.py`), checked."""
  for file in files:
    for number, record, size in _jsonl_records(file):
      where = f"{file} line {number}"
      yield chat.Conversation(chat.parse_messages(record, where), where, size)


def _parquet_texts(file: Path, field: str) -> Iterator[str]:
  with reading("--input", file):  # pyarrow's I/O errors are OSErrors, its other errors not
    try:
      table = pq.ParquetFile(file)
    except pa.ArrowException as error:
      raise ConfigError("--input", f"{file} is not a Parquet file ({error})") from None
    if field not in table.schema_arrow.names:
      raise ConfigError("--text_field", f"{file} has no column {field!r} (columns: "
                        f"{', '.join(table.schema_arrow.names)}); set --text_field to the text "
                        "column")
    for batch in table.iter_batches(batch_size=1024, columns=[field]):
      yield from (text for text in batch.column(0).to_pylist() if text)


def _batches(stream: Iterable[Item], size_of: Callable[[Item], int]) -> Iterator[list[Item]]:
  """Consecutive items, about BATCH_CHARS of input a batch."""
  batch, size = [], 0
  for item in stream:
    batch.append(item)
    size += size_of(item)
    if size >= BATCH_CHARS:
      yield batch
      batch, size = [], 0
  if batch:
    yield batch


def token_dtype(vocab_size: int) -> np.dtype:
  return np.dtype("<u2") if vocab_size <= 1 << 16 else np.dtype("<u4")


def prepare(inputs: Sequence[str], tokenizer_spec: str, out: str, *, input_format: str = "text",
            text_field: str = TEXT_FIELD, split_blank_lines: bool = False,
            val_fraction: float = 0.05) -> dict:
  """Tokenizes `inputs` into the directory `out` (module docstring); returns its meta.
  `input_format` "text" reads documents (text files, `text_field` of JSONL and
  Parquet), "chat" conversations from JSONL (`data/chat.py`); a `text_field`
  or `split_blank_lines` that no input would read is refused."""
  out_dir = Path(out)
  if out_dir.exists():
    raise ConfigError("--out", f"{out} already exists; remove it or choose another directory")
  if input_format not in INPUT_FORMATS:
    raise ConfigError("--format", f"{input_format!r} is not one of {', '.join(INPUT_FORMATS)}")
  if not 0 <= val_fraction < 1:
    raise ConfigError("--val_fraction", f"is {val_fraction}; use a share in [0, 1)")
  files = input_files(inputs)
  _check_read_options(files, input_format, text_field, split_blank_lines)
  total_bytes = sum(_size(f) for f in files)
  corpus = (_chat_corpus(files, tokenizer_spec) if input_format == "chat" else
            _text_corpus(files, tokenizer_spec, total_bytes, text_field=text_field,
                         split_blank_lines=split_blank_lines))
  tokenizer = corpus.tokenizer
  created, partial = _first_missing(out_dir.absolute().parent), None
  try:
    with _writing(out):  # an input that fails to read says so itself (`reading`)
      out_dir.absolute().parent.mkdir(parents=True, exist_ok=True)
      partial = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.partial-",
                                      dir=out_dir.absolute().parent))
      partial.chmod(0o755)  # mkdtemp makes it private
      counts = _write_tokens(corpus, partial, total_bytes)
      if not counts["documents"]:
        raise ConfigError("--input", f"{' '.join(inputs)} holds no text")
      split = _split(partial / DOCUMENTS_FILE, counts["tokens"], val_fraction)
      meta = {"format": FORMAT_VERSION, "tokenizer": tokenizer.spec,
              "vocab_size": tokenizer.vocab_size, "eos_id": tokenizer.eos_id,
              "bos_id": tokenizer.bos_id, "dtype": token_dtype(tokenizer.vocab_size).name,
              **counts, "split": split, "inputs": [str(f) for f in files],
              "input_format": input_format, "loss_mask": corpus.loss_mask, **corpus.meta,
              "tokenizer_source": tokenizer_spec}
      tokenizer.save(partial)
      (partial / tk.META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
      partial.rename(out_dir)
  except BaseException:
    if created or partial:
      shutil.rmtree(created or partial, ignore_errors=True)
    raise
  return meta


@contextlib.contextmanager
def _writing(out: str) -> Iterator[None]:
  """Writing the corpus that fails (a full disk, no permission) is one line naming `--out`."""
  try:
    yield
  except OSError as error:
    raise ConfigError("--out", f"writing {out} failed ({error.strerror or error})") from None


def _size(file: Path) -> int:
  with reading("--input", file):
    return file.stat().st_size


class _Corpus(NamedTuple):
  """What `prepare` writes: batches of the input (read once) and how to encode one."""

  tokenizer: tk.Tokenizer
  batches: Iterable[list]
  encode: Callable[[list], Encoded]
  loss_mask: bool  # whether `encode` gives masks
  meta: dict       # the input format's own entries of meta.json


def _text_corpus(files: Sequence[Path], tokenizer_spec: str, total_bytes: int, *,
                 text_field: str, split_blank_lines: bool) -> _Corpus:
  check_inputs(files, text_field)

  def stream() -> Iterator[Piece]:
    return pieces(files, text_field=text_field, split_blank_lines=split_blank_lines)

  tokenizer = _tokenizer(tokenizer_spec, stream, total_bytes)
  return _Corpus(tokenizer, _batches(stream(), lambda piece: len(piece[0])),
                 functools.partial(_encode_pieces, tokenizer), loss_mask=False,
                 meta={"text_field": text_field, "split_blank_lines": split_blank_lines})


def _chat_corpus(files: Sequence[Path], tokenizer_spec: str) -> _Corpus:
  for file in files:
    if file.suffix not in JSONL_SUFFIXES:
      raise ConfigError("--input", f"{file} is not a JSONL file; --format chat reads "
                        f"conversations, one a line as {chat.LINE_FORMAT}, from .jsonl files")
  tokenizer, template = chat.load(tokenizer_spec, key="--tokenizer")
  return _Corpus(tokenizer, _batches(conversations(files), lambda conversation: conversation.size),
                 functools.partial(_encode_conversations, tokenizer, template), loss_mask=True,
                 meta={})


def _encode_pieces(tokenizer: tk.Tokenizer, batch: list[Piece]) -> Encoded:
  texts, starts, ends = zip(*batch)
  return Encoded(tk.document_ids(tokenizer, texts, starts=starts, ends=ends), starts, None,
                 sum(len(text.encode("utf-8")) for text in texts))


def _encode_conversations(tokenizer: tk.HuggingFaceTokenizer, template: chat.ChatTemplate,
                          batch: list[chat.Conversation]) -> Encoded:
  ids, masks = chat.encode(tokenizer, template, batch)
  return Encoded(ids, [True] * len(ids), masks, sum(conversation.size for conversation in batch))


def _check_read_options(files: Sequence[Path], input_format: str, text_field: str,
                        split_blank_lines: bool) -> None:
  """`text_field` set away from TEXT_FIELD, or `split_blank_lines`, is an error
  where nothing reads it: conversations read each line's "messages", plain
  text files are not read by field, and only they split at blank lines."""
  by_field = JSONL_SUFFIXES + PARQUET_SUFFIXES
  plain = [f for f in files if f.suffix not in by_field]
  if input_format == "chat":
    why = {"--text_field": "--format chat reads each line's \"messages\"",
           "--split_blank_lines": "--format chat reads one conversation a line"}
  else:
    why = {"--text_field": None if len(plain) < len(files) else
           f"every input is plain text (none ends in {', '.join(by_field)})",
           "--split_blank_lines": None if plain else
           f"no input is plain text (each ends in one of {', '.join(by_field)})"}
  given = {"--text_field": text_field != TEXT_FIELD, "--split_blank_lines": split_blank_lines}
  for flag, reason in why.items():
    if given[flag] and reason:
      value = repr(text_field) if flag == "--text_field" else "set"
      raise ConfigError(flag, f"is {value} but ignored: {reason}; remove it")


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
  if not size.isdecimal():  # not isdigit: int() refuses superscripts
    raise ConfigError("--tokenizer", f"{spec!r}: give the vocabulary size as train:N, e.g. train:1024")
  with _progress(total_bytes, "train BPE") as bar:
    def texts() -> Iterator[str]:
      for text, _, _ in stream():
        bar.update(len(text.encode("utf-8")))
        yield text
    return tk.train_bpe(texts(), int(size), key="--tokenizer")


def _write_tokens(corpus: _Corpus, directory: Path, total_bytes: int) -> dict:
  """Encodes batch k+1 (Rust threads, GIL released) while writing batch k."""
  dtype = token_dtype(corpus.tokenizer.vocab_size)
  tokens = documents = learned = 0
  start = time.perf_counter()
  mask_file = (open(directory / LOSS_MASK_FILE, "wb") if corpus.loss_mask
               else contextlib.nullcontext())
  with (open(directory / TOKENS_FILE, "wb") as tokens_out,
        open(directory / DOCUMENTS_FILE, "wb") as documents_out,
        mask_file as mask_out,
        concurrent.futures.ThreadPoolExecutor(1) as encoder,
        _progress(total_bytes, "prepare") as bar):
    pending = None
    for batch in itertools.chain(corpus.batches, [None]):
      done, pending = pending, encoder.submit(corpus.encode, batch) if batch else None
      if done is None:
        continue
      encoded = done.result()
      lengths = np.fromiter(map(len, encoded.ids), np.int64, len(encoded.ids))
      offsets = tokens + np.concatenate([[0], np.cumsum(lengths)[:-1]])
      documents_out.write(offsets[np.asarray(encoded.starts)].astype("<i8").tobytes())
      tokens_out.write(np.concatenate(encoded.ids).astype(dtype).tobytes())
      if corpus.loss_mask:
        mask = np.concatenate(encoded.masks).astype(np.uint8)
        mask_out.write(mask.tobytes())
        learned += int(mask.sum())
      tokens += int(lengths.sum())
      documents += int(np.sum(encoded.starts))
      bar.update(encoded.size)
      bar.set_postfix(tok_s=f"{tokens / (time.perf_counter() - start):,.0f}")
    documents_out.write(np.array([tokens], "<i8").tobytes())
  if corpus.loss_mask and tokens and not learned:
    raise ConfigError("--input", "no conversation has an assistant turn, so no token counts in "
                      "the loss and training would learn nothing; give conversations with "
                      "assistant replies")
  return {"documents": documents, "tokens": tokens}


@contextlib.contextmanager
def _progress(total_bytes: int, desc: str) -> Iterator[tqdm]:
  """A progress bar over the input bytes, on a terminal only (none in logs),
  wiped when the work fails, so that the error is the one line left."""
  bar = tqdm(total=total_bytes, unit="B", unit_scale=True, desc=desc, disable=None)
  try:
    yield bar
  except BaseException:
    bar.leave = False
    raise
  finally:
    bar.close()


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
