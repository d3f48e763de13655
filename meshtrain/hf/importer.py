"""`meshtrain import-hf` and `config.init_from=hf:DIR`: a Hugging Face Llama as a run's start.

`import_hf` writes a workdir that `meshtrain train` continues (fine-tuning) and
that `export-hf` and `generate` read: `config.json` (the given config with the
model's shape), the source's own config as `hf_config.json` (kept for export),
its tokenizer files, and a step-0 checkpoint (the imported weights and a fresh
optimizer state) in `checkpoints/`, as `train` writes them.
"""

import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp

from meshtrain import workdir as saved_run
from meshtrain.checkpoint import Checkpoints
from meshtrain.data import make_iterator
from meshtrain.data import tokenizer as tokenizers
from meshtrain.errors import ConfigError
from meshtrain.hf import config as hf_config
from meshtrain.hf.load import check_model, load_params
from meshtrain.train.setup import Setup, build
from meshtrain.train.state import TrainState

HF_CONFIG_FILE = "hf_config.json"  # in a workdir: the imported model's config.json
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "generation_config.json")
PREFIX = "hf:"


def initial_state(setup: Setup, directory, *, key: str) -> TrainState:
  """The train state at step 0 with the weights of the Hugging Face Llama in `directory`."""
  params = load_params(directory, setup.spec.abstract_params, setup.shardings.params, key=key)
  def create(params):
    return TrainState(jnp.zeros((), jnp.int32), params, setup.optimizer.init(params),
                      jnp.zeros((), jnp.int32))
  with jax.set_mesh(setup.mesh):
    return jax.jit(create, out_shardings=setup.shardings, donate_argnums=0)(params)


def init_from(cfg, setup: Setup) -> TrainState:
  """The start of a run with `config.init_from=hf:DIR`; its `config.model` must be DIR's model."""
  key = "config.init_from"
  if not cfg.init_from.startswith(PREFIX):
    raise ConfigError(key, f"{cfg.init_from!r} is not '' or 'hf:DIR' (a Hugging Face model "
                      "directory)")
  directory = cfg.init_from[len(PREFIX):]
  check_model(directory, cfg.model, key=key)
  return initial_state(setup, directory, key=key)


def import_hf(cfg, source, workdir) -> Path:
  """Writes `workdir` from the Hugging Face Llama in `source` on the mesh of `cfg`."""
  source, workdir = Path(source), Path(workdir).absolute()
  hf = hf_config.read(source, key="--from")
  run = (workdir / "checkpoints").exists() or (workdir / "config.json").exists()
  saved_run.check_new_directory(workdir, "--to", "a run" if run else None)
  cfg.model.update(hf_config.model_keys(hf))
  cfg.workdir = str(workdir)
  has_tokenizer = (source / tokenizers.TOKENIZER_FILE).is_file()
  if has_tokenizer:
    tokenizers.load(str(source), key="--from")  # fails here, not after writing
    cfg.tokenizer = str(workdir)
  setup = build(cfg)
  state = initial_state(setup, source, key="--from")
  batches = make_iterator(cfg.data, seq_len=cfg.seq_len, global_batch=cfg.global_batch,
                          vocab_size=cfg.model.vocab_size, seed=cfg.seed)
  if jax.process_index() == 0:
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2))
    (workdir / HF_CONFIG_FILE).write_text(json.dumps(hf, indent=2))
    for name in TOKENIZER_FILES if has_tokenizer else ():
      if (source / name).is_file():
        shutil.copyfile(source / name, workdir / name)
  checkpoints = Checkpoints(workdir / "checkpoints", keep=cfg.checkpoint.keep, config_key="--to")
  try:
    checkpoints.save(0, state, batches, cfg)
  finally:
    checkpoints.close()
  return workdir
