"""Tests for meshtrain.data: batch layout, global order, resumption, errors."""

import json
import math
from pathlib import Path

import ml_collections
import numpy as np
import pytest

from meshtrain.data import STRIDES, make_iterator, synthetic_loss_floor
from meshtrain.data.prepare import prepare
from meshtrain.errors import ConfigError

SEQ_LEN = 32
GLOBAL_BATCH = 8
VOCAB_SIZE = 256

Batch = dict[str, np.ndarray]


def data_config(
    source: str, path: str | Path | None = None, packing: str = "concat"
) -> ml_collections.ConfigDict:
  return ml_collections.ConfigDict(
      {"source": source, "path": "" if path is None else str(path), "packing": packing}
  )


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, real_text) -> Path:
  """The text's paragraphs as documents, byte tokens (EOS 0), 10% held out."""
  out = tmp_path_factory.mktemp("prepared") / "text"
  prepare([str(real_text)], "bytes", str(out), split_blank_lines=True, val_fraction=0.1)
  return out


@pytest.fixture(params=["synthetic", "text", "tokens"])
def cfg(request) -> ml_collections.ConfigDict:
  if request.param == "tokens":
    return data_config("tokens", request.getfixturevalue("corpus"))
  return data_config(request.param, request.getfixturevalue("real_text"))


def iterator(
    cfg,
    *,
    seed: int = 0,
    global_batch: int = GLOBAL_BATCH,
    vocab_size: int = VOCAB_SIZE,
    seq_len: int = SEQ_LEN,
    **process,
):
  return make_iterator(
      cfg,
      seq_len=seq_len,
      global_batch=global_batch,
      vocab_size=vocab_size,
      seed=seed,
      **process,
  )


def draw(it, steps: int) -> list[Batch]:
  return [next(it) for _ in range(steps)]


def assert_same_batches(actual: list[Batch], expected: list[Batch]):
  assert len(actual) == len(expected)
  for got, want in zip(actual, expected):
    np.testing.assert_array_equal(got["inputs"], want["inputs"])
    np.testing.assert_array_equal(got["targets"], want["targets"])


def windows_of(batch: Batch) -> np.ndarray:
  """The seq_len + 1 tokens behind each row."""
  return np.concatenate([batch["inputs"], batch["targets"][:, -1:]], axis=1)


def test_batch_shapes_and_dtypes(cfg):
  batch = next(iterator(cfg))
  assert set(batch) == {"inputs", "targets"}
  for array in batch.values():
    assert array.shape == (GLOBAL_BATCH, SEQ_LEN)
    assert array.dtype == np.int32
    assert 0 <= array.min() and array.max() < VOCAB_SIZE


def test_targets_are_inputs_shifted_by_one(cfg):
  for batch in draw(iterator(cfg), 3):
    np.testing.assert_array_equal(
        batch["targets"][:, :-1], batch["inputs"][:, 1:]
    )


def test_text_tokens_decode_to_substrings_of_the_file(real_text):
  text = real_text.read_bytes()
  for batch in draw(iterator(data_config("text", real_text)), 2):
    for window in windows_of(batch):
      assert bytes(window.astype(np.uint8)) in text


def test_every_text_epoch_visits_each_window_once(tmp_path):
  num_windows = 16
  text = np.full(num_windows * SEQ_LEN + 1, ord("."), dtype=np.uint8)
  text[::SEQ_LEN] = np.arange(num_windows + 1)  # Each window opens with its id.
  path = tmp_path / "numbered.txt"
  path.write_bytes(text.tobytes())
  it = iterator(data_config("text", path), global_batch=num_windows)
  epochs = [next(it)["inputs"][:, 0] for _ in range(2)]
  for ids in epochs:
    np.testing.assert_array_equal(np.sort(ids), np.arange(num_windows))
  assert not np.array_equal(*epochs)


@pytest.mark.parametrize("process_count", [2, 4])
def test_process_slices_concatenate_to_the_global_batch(cfg, process_count):
  steps, rows = 4, GLOBAL_BATCH // process_count
  global_batches = draw(iterator(cfg), steps)
  per_process = [
      draw(iterator(cfg, rows=range(i * rows, (i + 1) * rows)), steps)
      for i in range(process_count)
  ]
  for step, global_batch in enumerate(global_batches):
    for key in ("inputs", "targets"):
      slices = [batches[step][key] for batches in per_process]
      assert slices[0].shape[0] == GLOBAL_BATCH // process_count
      np.testing.assert_array_equal(np.concatenate(slices), global_batch[key])


def test_set_state_resumes_exactly(cfg):
  it = iterator(cfg)
  draw(it, 3)
  state = json.loads(json.dumps(it.get_state()))  # As a checkpoint keeps it.
  expected = draw(it, 2)
  resumed = iterator(cfg)
  resumed.set_state(state)
  assert_same_batches(draw(resumed, 2), expected)


def test_different_seeds_give_different_orders(cfg):
  first = next(iterator(cfg, seed=0))["inputs"]
  second = next(iterator(cfg, seed=1))["inputs"]
  assert not np.array_equal(first, second)


def test_synthetic_is_deterministic():
  cfg = data_config("synthetic")
  assert_same_batches(
      draw(iterator(cfg, seed=3), 3), draw(iterator(cfg, seed=3), 3)
  )


def test_synthetic_rows_are_progressions_with_a_known_stride():
  offsets = np.arange(SEQ_LEN + 1)
  for batch in draw(iterator(data_config("synthetic")), 3):
    windows = windows_of(batch).astype(np.int64)
    strides = (windows[:, 1] - windows[:, 0]) % VOCAB_SIZE
    assert set(strides.tolist()) <= set(STRIDES)
    expected = (windows[:, :1] + strides[:, None] * offsets) % VOCAB_SIZE
    np.testing.assert_array_equal(windows, expected)


def test_every_synthetic_epoch_draws_each_progression_once():
  vocab_size = 8
  num_progressions = vocab_size * len(STRIDES)
  batches_per_epoch = num_progressions // GLOBAL_BATCH
  it = iterator(data_config("synthetic"), vocab_size=vocab_size)
  epochs = []
  for _ in range(2):
    windows = np.concatenate(
        [windows_of(batch) for batch in draw(it, batches_per_epoch)]
    )
    starts = windows[:, 0]
    strides = (windows[:, 1] - windows[:, 0]) % vocab_size
    progressions = list(zip(starts.tolist(), strides.tolist()))
    assert len(set(progressions)) == num_progressions
    epochs.append(progressions)
  assert epochs[0] != epochs[1]


def test_synthetic_loss_floor():
  assert synthetic_loss_floor(SEQ_LEN, VOCAB_SIZE) == pytest.approx(
      math.log(len(STRIDES)) / SEQ_LEN
  )


def assert_config_error(key: str, cfg, **kwargs):
  with pytest.raises(ConfigError, match=key.replace(".", r"\.")) as error:
    iterator(cfg, **kwargs)
  assert error.value.key == key


def test_unknown_source_is_a_config_error():
  assert_config_error("config.data.source", data_config("imagenet"))
  with pytest.raises(ConfigError, match="synthetic, text"):
    iterator(data_config("imagenet"))


def test_missing_path_is_a_config_error(tmp_path):
  for path in (None, tmp_path / "missing.txt", tmp_path):
    assert_config_error("config.data.path", data_config("text", path))


def test_empty_or_short_file_is_a_config_error(tmp_path):
  empty = tmp_path / "empty.txt"
  empty.write_bytes(b"")
  short = tmp_path / "short.txt"
  short.write_bytes(b"x" * SEQ_LEN)
  for path in (empty, short):
    assert_config_error("config.data.path", data_config("text", path))


def test_empty_global_batch_is_a_config_error():
  assert_config_error("config.global_batch", data_config("synthetic"), global_batch=0)


def test_negative_seed_is_a_config_error():
  assert_config_error("config.seed", data_config("synthetic"), seed=-1)


def test_text_bytes_beyond_the_vocabulary_are_a_config_error(tmp_path):
  path = tmp_path / "accents.txt"
  path.write_text("café " * SEQ_LEN, encoding="utf-8")
  assert_config_error(
      "config.model.vocab_size", data_config("text", path), vocab_size=128
  )


def test_too_small_synthetic_vocabulary_is_a_config_error():
  assert_config_error(
      "config.model.vocab_size", data_config("synthetic"), vocab_size=4
  )
  with pytest.raises(ConfigError, match=r"config\.model\.vocab_size"):
    synthetic_loss_floor(SEQ_LEN, 4)


def prepared_tokens(corpus: Path, split: str) -> np.ndarray:
  meta = json.loads((corpus / "meta.json").read_text())
  start, end = meta["split"][split]
  return np.fromfile(corpus / "tokens.bin", meta["dtype"])[start:end]


@pytest.mark.parametrize("split", ["train", "val"])
def test_token_windows_are_slices_of_their_split(corpus, split):
  stream = prepared_tokens(corpus, split).tobytes()
  for batch in draw(iterator(data_config("tokens", corpus), split=split), 2):
    for window in windows_of(batch):
      assert window.astype(np.uint16).tobytes() in stream


def test_segments_restart_after_each_end_of_document(corpus):
  """Against a plain loop over the tokens: byte tokens end a document with 0,
  which no paragraph contains."""
  batches = draw(iterator(data_config("tokens", corpus, packing="segments"), seq_len=64), 3)
  documents_seen = 0
  for batch in batches:
    assert set(batch) == {"inputs", "targets", "segment_ids", "positions"}
    for inputs, segment_ids, positions in zip(batch["inputs"], batch["segment_ids"],
                                              batch["positions"]):
      segment, position = 1, 0
      for t, token in enumerate(inputs):
        if t and inputs[t - 1] == 0:
          segment, position = segment + 1, 0
        assert (segment_ids[t], positions[t]) == (segment, position), t
        position += 1
      documents_seen += segment
  assert documents_seen > 3 * GLOBAL_BATCH  # windows do cross documents


def test_concat_and_segments_draw_the_same_tokens(corpus):
  concat = draw(iterator(data_config("tokens", corpus)), 2)
  segments = draw(iterator(data_config("tokens", corpus, packing="segments")), 2)
  assert_same_batches(segments, concat)


def test_a_smaller_model_vocabulary_than_the_tokenizers_is_a_config_error(corpus):
  assert_config_error("config.model.vocab_size", data_config("tokens", corpus), vocab_size=255)
  with pytest.raises(ConfigError, match="set it to at least 256"):
    iterator(data_config("tokens", corpus), vocab_size=100)
  next(iterator(data_config("tokens", corpus), vocab_size=384))  # larger: padding rows


def test_a_missing_or_unfinished_prepared_directory_is_a_config_error(corpus, tmp_path):
  unfinished = tmp_path / "corpus"
  unfinished.mkdir()
  (tmp_path / ".corpus.partial-x1").mkdir()
  for path, message in ((None, "is not set"), (tmp_path / "nope", "not a directory"),
                        (unfinished, "prepare did not finish")):
    with pytest.raises(ConfigError, match=message):
      iterator(data_config("tokens", path))
  assert_config_error("config.data.path", data_config("tokens", unfinished))


def test_unknown_packing_is_a_config_error():
  assert_config_error("config.data.packing", data_config("synthetic", packing="zip"))
