"""`meshtrain import-hf`: a Hugging Face model written as a run's step 0.

Above `validate` (the imported model's config is checked as a run's) and the
training path (the step-0 state is a run's); the files themselves are
`meshtrain.hf.importer`'s.
"""

from pathlib import Path

import jax

from meshtrain import validate, workdir as saved_run
from meshtrain.checkpoint import Checkpoints
from meshtrain.data import make_iterator, tokenizer as tokenizers
from meshtrain.errors import ConfigError
from meshtrain.hf import config as hf_config, importer
from meshtrain.hf.load import check_mtp_layers
from meshtrain.train.resume import initial_state
from meshtrain.train.setup import build


def prepare(cfg, source: Path, workdir: Path) -> tuple[dict, bool]:
  """Checks `source` and `workdir` before anything is written and sets `cfg`'s
  model, workdir and tokenizer for the import. `cfg` is one that
  `validate.check_config` passed (the CLI checks it before); with the model
  set, its values are checked again, a failure there being the model's. Returns
  the source's config and whether it has a tokenizer. `cfg`'s own
  `model.mtp_layers` stays: how many of the source's multi-token prediction
  modules (at most all) the run imports and trains."""
  hf = hf_config.read(source, key="--from")
  run = (workdir / "checkpoints").exists() or (workdir / "config.json").exists()
  saved_run.check_new_directory(workdir, "--to", "a run" if run else None)
  try:
    cfg.model.update(hf_config.model_keys(hf))
    hf_config.apply_balancing(hf, cfg.model.moe)
    validate.check_values(cfg)
  except (ConfigError, TypeError) as error:  # TypeError: a value of the wrong type
    raise ConfigError("--from", f"{source / hf_config.CONFIG_FILE} does not make a model "
                      f"meshtrain runs ({error})") from None
  check_mtp_layers(source, hf, cfg.model.mtp_layers)
  cfg.workdir = str(workdir)
  has_tokenizer = (source / tokenizers.TOKENIZER_FILE).is_file()
  if has_tokenizer:
    tokenizers.load(str(source), key="--from")  # fails here, not after writing
    cfg.tokenizer = str(workdir)
  return hf, has_tokenizer


def import_hf(cfg, source, workdir) -> Path:
  """Writes `workdir` from the Hugging Face model in `source` on the mesh of
  `cfg` (a config `validate.check_config` passed): its files
  (`meshtrain.hf.importer`) and a step-0 checkpoint."""
  source, workdir = Path(source), Path(workdir).absolute()
  hf, has_tokenizer = prepare(cfg, source, workdir)
  setup = build(cfg)
  cfg = setup.cfg  # saved as a run saves it (resolved), so that the run resumes it
  state = initial_state(setup, source, key="--from")
  batches = make_iterator(cfg.data, seq_len=cfg.seq_len, global_batch=cfg.global_batch,
                          vocab_size=cfg.model.vocab_size, seed=cfg.seed)
  if jax.process_index() == 0:
    importer.write_files(cfg, hf, source, workdir, has_tokenizer)
  checkpoints = Checkpoints(workdir / "checkpoints", keep=cfg.checkpoint.keep, config_key="--to")
  try:
    checkpoints.save(0, state, batches, cfg)
  finally:
    checkpoints.close()
  return workdir
