"""Bad input through the CLI (in-process, as `meshtrain COMMAND ...` parses it):
each case ends with exit 2 and one `error: <key>: ...` line naming the key, no
traceback, no warning logged (absl and orbax would print it on stderr), and the
workdir byte for byte as it was. Also: README.md's count
of these cases, and the config checks that start-up runs before it fails or
starts processes, each run once, and the config's tokenizer read once."""

import collections
import hashlib
import json
import logging
import re
import shutil

import pytest
import tokenizers as hf_tokenizers

from conftest import REPO, cli_in_process, micro_config, micro_flags
from meshtrain import generate as generation, launch as launcher, validate
from meshtrain.checkpoint import Checkpoints
from meshtrain.data import make_iterator, tokenizer as tokenizers
from meshtrain.errors import ConfigError
from meshtrain.train.setup import build

PIPELINE = ["--config.mesh.data=4", "--config.mesh.pipeline=2"]
MLA = ["--config.model.mla.kv_lora_rank=16", "--config.model.num_kv_heads=4",
       "--config.mesh.data=1", "--config.mesh.fsdp=8"]
CASES = [
    # keys and types
    ("train", ["--config.stepz=5"], "config.stepz"),
    ("train", ["--config.mesh.dat=8"], "config.mesh.dat"),
    ("train", ["--config.learning_rate=0.1"], "config.learning_rate"),
    ("train", ["--config.optimizer.lr=0.1"], "config.optimizer.lr"),
    ("train", ["--config.mesh=3"], "config.mesh"),
    ("train", ["--config.nosteps"], "config.nosteps"),
    ("train", ["--config.steps=abc"], "config.steps"),
    ("train", ["--config.steps=1.5"], "config.steps"),
    ("train", ["--config.model.tie_embeddings=maybe"], "config.model.tie_embeddings"),
    ("train", ["--config.optimizer.b1=high"], "config.optimizer.b1"),
    ("train", ["--config=no/such/config.py"], "--config"),
    ("train", [f"--config={REPO}/configs/tp.py:nosuch"], "--config"),
    ("train", ["--nosuchflag"], "--nosuchflag"),
    ("train", ["--stages=abc"], "--stages"),
    ("train", ["--config={tmp}/typo.py"], "config.stepz"),
    ("train", ["--config={tmp}/broken.py"], "--config"),
    ("train", ["--config={tmp}/wrong_type.py"], "--config"),
    ("train", ["configs/tiny.py"], "train"),
    ("trian", [], "command"),
    # ranges of one key
    ("train", ["--config.steps=0"], "config.steps"),
    ("train", ["--config.steps=-5"], "config.steps"),
    ("train", ["--config.global_batch=0"], "config.global_batch"),
    ("train", ["--config.seq_len=0"], "config.seq_len"),
    ("train", ["--config.grad_accum_steps=0"], "config.grad_accum_steps"),
    ("train", ["--config.log_every=0"], "config.log_every"),
    ("train", ["--config.seed=-1"], "config.seed"),
    ("train", ["--config.simulate_devices=-1"], "config.simulate_devices"),
    ("train", ["--config.simulate_devices=100000"], "config.simulate_devices"),  # would hang
    ("train", ["--config.peak_flops=-1"], "config.peak_flops"),
    ("train", ["--config.peak_flops=inf"], "config.peak_flops"),
    ("train", ["--config.model.num_layers=0"], "config.model.num_layers"),
    ("train", ["--config.model.vocab_size=0"], "config.model.vocab_size"),
    ("train", ["--config.model.embed_dim=-1"], "config.model.embed_dim"),
    ("train", ["--config.model.num_heads=0"], "config.model.num_heads"),
    ("train", ["--config.model.rope_theta=0"], "config.model.rope_theta"),
    ("train", ["--config.model.norm_eps=-1e-5"], "config.model.norm_eps"),
    ("train", ["--config.optimizer.learning_rate=nan"], "config.optimizer.learning_rate"),
    ("train", ["--config.optimizer.learning_rate=-0.001"], "config.optimizer.learning_rate"),
    ("train", ["--config.optimizer.learning_rate=inf"], "config.optimizer.learning_rate"),
    ("train", ["--config.optimizer.b1=1.0"], "config.optimizer.b1"),
    ("train", ["--config.optimizer.b2=-0.1"], "config.optimizer.b2"),
    ("train", ["--config.optimizer.eps=0"], "config.optimizer.eps"),
    ("train", ["--config.optimizer.weight_decay=-0.1"], "config.optimizer.weight_decay"),
    ("train", ["--config.optimizer.clip_norm=-1"], "config.optimizer.clip_norm"),
    ("train", ["--config.optimizer.warmup_steps=-1"], "config.optimizer.warmup_steps"),
    ("train", ["--config.optimizer.min_lr_ratio=2"], "config.optimizer.min_lr_ratio"),
    ("train", ["--config.checkpoint.every_steps=-1"], "config.checkpoint.every_steps"),
    ("train", ["--config.checkpoint.keep=-1"], "config.checkpoint.keep"),
    ("train", ["--config.param_dtype=float64"], "config.param_dtype"),
    ("train", ["--config.compute_dtype=fp16"], "config.compute_dtype"),
    ("train", ["--config.remat=some"], "config.remat"),
    ("train", ["--config.zero_stage=4"], "config.zero_stage"),
    ("train", ["--config.nan_policy=ignore"], "config.nan_policy"),
    ("train", ["--config.data.source=csv"], "config.data.source"),
    ("train", ["--config.mesh.sequence=2", "--config.attention.sequence_strategy=zigzag"],
     "config.attention.sequence_strategy"),
    ("train", ["--config.attention.implementation=flash"], "config.attention.implementation"),
    ("train", [*PIPELINE, "--config.pipeline.schedule=zb"], "config.pipeline.schedule"),
    ("train", ["--config.distributed.num_processes=-1"], "config.distributed.num_processes"),
    ("train", ["--config.distributed.num_processes=2"], "config.distributed.coordinator_address"),
    ("train", ["--config.distributed.timeout_s=0"], "config.distributed.timeout_s"),
    ("train", ["--config.distributed.num_processes=2", "--config.distributed.process_id=0",
               "--config.distributed.coordinator_address=localhost"],
     "config.distributed.coordinator_address"),
    ("train", ["--config.workdir="], "config.workdir"),
    # Mixture-of-Experts
    ("train", ["--config.model.moe.experts_per_token=3"], "config.model.moe.experts_per_token"),
    ("train", ["--config.expert_parallel=data"], "config.expert_parallel"),
    ("train", ["--config.model.moe.num_experts=6", "--config.mesh.data=1",
               "--config.mesh.fsdp=8"], "config.model.moe.num_experts"),
    ("train", ["--config.model.moe.num_experts=4", "--config.model.moe.experts_per_token=5"],
     "config.model.moe.experts_per_token"),
    ("train", ["--config.model.moe.num_experts=4", "--config.model.moe.router=relu"],
     "config.model.moe.router"),
    ("train", ["--config.model.moe.num_experts=4", "--config.experts.grouped_gemm=cutlass"],
     "config.experts.grouped_gemm"),
    ("train", ["--config.model.moe.num_experts=4", "--config.experts.grouped_gemm=hopper"],
     "config.experts.grouped_gemm"),  # no Hopper GPU here
    ("train", ["--config.model.moe.num_experts=4", "--config.experts.dispatch=sparse"],
     "config.experts.dispatch"),
    ("train", ["--config.model.moe.num_experts=8", "--config.mesh.data=1", "--config.mesh.fsdp=8",
               "--config.experts.dispatch=ragged"], "config.experts.dispatch"),  # a CPU
    ("train", ["--config.experts.dispatch=ragged"], "config.experts.dispatch"),  # no experts
    ("train", ["--config.model.moe.dispatch=padded"], "config.model.moe.dispatch"),  # moved
    ("train", ["--config.model.moe.num_experts=4", "--config.expert_parallel=tensor"],
     "config.expert_parallel"),
    ("train", [*PIPELINE, "--config.model.moe.num_experts=4", "--config.expert_parallel=data"],
     "config.expert_parallel"),  # the pipeline holds `data` itself
    ("train", ["--config.model.moe.num_experts=4", "--config.model.moe.first_dense_layers=2"],
     "config.model.moe.first_dense_layers"),
    ("train", ["--config.model.moe.num_experts=8", "--config.model.moe.group_scored_by=1"],
     "config.model.moe.group_scored_by"),  # no groups
    ("train", ["--config.model.moe.num_experts=8", "--config.model.moe.expert_groups=2",
               "--config.model.moe.groups_per_token=1", "--config.model.moe.group_scored_by=0"],
     "config.model.moe.group_scored_by"),
    # Multi-head Latent Attention
    ("train", ["--config.model.mla.q_lora_rank=8"], "config.model.mla.q_lora_rank"),
    ("train", ["--config.model.mla.kv_lora_rank=-16"], "config.model.mla.kv_lora_rank"),
    ("train", ["--config.model.mla.kv_lora_rank=16"], "config.model.num_kv_heads"),
    *[("train", [*MLA, flag], key) for flag, key in (
        ("--config.model.mla.rope_head_dim=3", "config.model.mla.rope_head_dim"),
        ("--config.model.mla.v_head_dim=0", "config.model.mla.v_head_dim"),
        ("--config.model.qk_norm=true", "config.model.qk_norm"),
        ("--config.model.mla.q_lora_rank=12", "config.model.mla.q_lora_rank"))],  # fsdp=8
    ("train", ["--config.model.moe.num_experts=8", "--config.model.moe.capacity_factor=-1"],
     "config.model.moe.capacity_factor"),
    ("train", ["--config.model.moe.num_experts=4", "--config.mesh.data=4", "--config.mesh.tensor=2",
               "--config.model.moe.shared_mlp_dim=7"], "config.model.moe.shared_mlp_dim"),
    ("train", ["--config.model.moe.num_experts=4", "--config.model.moe.shared_gate=true"],
     "config.model.moe.shared_gate"),  # no shared expert to gate
    ("train", ["--config.model.mtp_layers=-1"], "config.model.mtp_layers"),
    ("train", ["--config.seq_len=8", "--config.model.mtp_layers=8"], "config.model.mtp_layers"),
    ("train", ["--config.model.mtp_loss_coef=0.3"], "config.model.mtp_loss_coef"),  # no modules
    ("train", ["--config.model.mtp_layers=1", "--config.model.mtp_loss_coef=-0.1"],
     "config.model.mtp_loss_coef"),
    # optimizer, local SGD, loss scaling, evaluation, RoPE scaling, tokenizer
    ("train", ["--config.optimizer.name=adamx"], "config.optimizer.name"),
    ("train", ["--config.optimizer.momentum=0.5"], "config.optimizer.momentum"),  # adamw's
    ("train", ["--config.optimizer.name=sgd", "--config.optimizer.momentum=2"],
     "config.optimizer.momentum"),
    ("train", ["--config.local_sgd.outer_learning_rate=0.5"],
     "config.local_sgd.outer_learning_rate"),
    ("train", ["--config.local_sgd.inner_steps=2", "--config.local_sgd.outer_momentum=1.5"],
     "config.local_sgd.outer_momentum"),
    ("train", ["--config.local_sgd.inner_steps=100"], "config.local_sgd.inner_steps"),
    ("train", ["--config.steps=99999999999"], "config.steps"),
    ("train", ["--config.loss_scale.initial=1024"], "config.loss_scale.initial"),  # float32
    ("train", ["--config.compute_dtype=float16", "--config.loss_scale.period=0"],
     "config.loss_scale.period"),
    ("train", ["--config.eval.batches=0"], "config.eval.batches"),
    ("train", ["--config.model.rope_scaling_factor=0"], "config.model.rope_scaling_factor"),
    ("train", ["--config.model.rope_low_freq_factor=2"], "config.model.rope_low_freq_factor"),
    ("train", ["--config.model.rope_scaling_factor=8", "--config.model.rope_high_freq_factor=1"],
     "config.model.rope_high_freq_factor"),
    ("train", ["--config.model.rope_scaling_factor=4", "--config.model.rope_scaling_type=ntk"],
     "config.model.rope_scaling_type"),
    ("train", ["--config.model.rope_scaling_type=yarn"], "config.model.rope_scaling_type"),
    ("train", ["--config.model.rope_beta_fast=16"], "config.model.rope_beta_fast"),
    ("train", ["--config.model.rope_scaling_factor=4", "--config.model.rope_mscale=1"],
     "config.model.rope_mscale"),  # llama3 scaling has no mscale
    ("train", ["--config.model.rope_scaling_factor=4", "--config.model.rope_scaling_type=yarn",
               "--config.model.rope_low_freq_factor=2"], "config.model.rope_low_freq_factor"),
    ("train", ["--config.model.rope_scaling_factor=4", "--config.model.rope_scaling_type=yarn",
               "--config.model.rope_beta_fast=1", "--config.model.rope_beta_slow=2"],
     "config.model.rope_beta_fast"),
    ("train", ["--config.model.rope_scaling_factor=4", "--config.model.rope_scaling_type=yarn",
               "--config.model.rope_mscale=-1"], "config.model.rope_mscale"),
    ("train", ["--config.tokenizer=no/such/tokenizer"], "config.tokenizer"),
    # a key that another key's value makes do nothing
    ("train", ["--config.data.path={text}"], "config.data.path"),
    ("train", ["--config.data.path=no/such/file.txt"], "config.data.path"),
    ("train", ["--config.data.source=text", "--config.data.path={tmp}/binary.bin",
               "--config.model.vocab_size=256"], "config.data.path"),  # bytes 0-255, then ff fe
    ("train", ["--config.attention.sequence_strategy=ring"], "config.attention.sequence_strategy"),
    ("train", ["--config.tensor_sequence_parallel=true"], "config.tensor_sequence_parallel"),
    ("train", ["--config.pipeline.microbatches=8"], "config.pipeline.microbatches"),
    ("train", ["--config.distributed.process_id=3"], "config.distributed.process_id"),
    # across keys: mesh x model x strategy x schedule x attention x data
    ("train", ["--config.data.source=text", "--config.data.path=no/such/file.txt"],
     "config.data.path"),
    ("train", ["--config.mesh.data=3"], "config.mesh"),
    ("train", ["--config.mesh.data=-1", "--config.mesh.fsdp=-1"], "config.mesh.fsdp"),
    ("train", ["--config.mesh.data=2", "--config.mesh.pipeline=-1"], "config.mesh.pipeline"),
    ("train", ["--config.model.mlp_dim=100000000"], "config.mesh"),  # 2 TiB of state a device
    ("train", ["--config.mesh.tensor=3"], "config.mesh.data"),
    ("train", ["--config.mesh.data=0"], "config.mesh.data"),
    ("train", ["--config.mesh.data=8", "--config.global_batch=12"], "config.global_batch"),
    ("train", ["--config.mesh.data=8", "--config.grad_accum_steps=3"], "config.grad_accum_steps"),
    ("train", ["--config.model.num_kv_heads=3"], "config.model.num_kv_heads"),
    ("train", ["--config.model.head_dim=7"], "config.model.head_dim"),
    ("train", ["--config.mesh.data=1", "--config.mesh.tensor=8"], "config.model.num_heads"),
    ("train", ["--config.mesh.data=1", "--config.mesh.fsdp=8", "--config.model.embed_dim=36"],
     "config.model.embed_dim"),
    ("train", ["--config.mesh.data=1", "--config.mesh.sequence=8",
               "--config.attention.sequence_strategy=ulysses"], "config.attention.sequence_strategy"),
    ("train", ["--config.mesh.data=1", "--config.mesh.sequence=8", "--config.seq_len=24",
               "--config.attention.sequence_strategy=ring"], "config.attention.sequence_strategy"),
    ("train", ["--config.mesh.data=1", "--config.mesh.sequence=8", "--config.seq_len=20"],
     "config.seq_len"),
    ("train", ["--config.attention.implementation=cudnn"], "config.attention.implementation"),
    ("train", [*PIPELINE, "--config.model.num_layers=3"], "config.model.num_layers"),
    ("train", [*PIPELINE, "--config.pipeline.stage_layers=1,x"], "config.pipeline.stage_layers"),
    ("train", [*PIPELINE, "--config.pipeline.stage_layers=1,1,1"],
     "config.pipeline.stage_layers"),
    ("train", [*PIPELINE, "--config.pipeline.stage_layers=2,1"], "config.pipeline.stage_layers"),
    ("train", [*PIPELINE, "--config.pipeline.stage_layers=2,0"], "config.pipeline.stage_layers"),
    ("train", ["--config.pipeline.stage_layers=1,1"], "config.pipeline.stage_layers"),
    ("train", [*PIPELINE, "--config.pipeline.microbatches=3"], "config.pipeline.microbatches"),
    ("train", [*PIPELINE, "--config.grad_accum_steps=3"], "config.pipeline.microbatches"),
    ("train", [*PIPELINE, "--config.model.num_layers=4", "--config.pipeline.virtual_stages=2"],
     "config.pipeline.virtual_stages"),
    ("train", [*PIPELINE, "--config.model.num_layers=4", "--config.pipeline.virtual_stages=2",
               "--config.pipeline.schedule=interleaved_1f1b", "--config.pipeline.microbatches=1"],
     "config.pipeline.microbatches"),
    ("train", [*PIPELINE, "--config.grad_dtype=bfloat16"], "config.grad_dtype"),
    ("train", ["--config.mesh.across_hosts=datum"], "config.mesh.across_hosts"),
    # the workdir and checkpoints
    ("train", ["--config.workdir={tmp}/a_file"], "config.workdir"),
    ("train", ["--config.workdir={tmp}/a_file/run"], "config.workdir"),
    ("train", ["--config.workdir={tmp}/hf_model"], "config.workdir"),
    ("train", ["--config.checkpoint.restore_from={tmp}/nowhere"], "config.checkpoint.restore_from"),
    ("train", ["--config.workdir={run}", "--config.seed=1"], "config.workdir"),
    ("train", ["--config.workdir={run}", "--config.global_batch=32"], "config.workdir"),
    ("train", ["--config.workdir={run}", "--config.seq_len=32"], "config.workdir"),
    ("train", ["--config.workdir={run}", "--config.model.num_layers=4"], "config.workdir"),
    ("train", ["--config.workdir={run}", "--config.data.source=text",
               "--config.data.path={text}", "--config.model.vocab_size=256"],
     "config.workdir"),
    # the other commands
    ("plan", ["--devices=0"], "--devices"),
    ("plan", ["--devices=8", "--mesh=data=8"], "--mesh"),  # a flag of plan --search alone
    ("plan", ["--devices=8", "--config.mesh.data=3"], "config.mesh"),
    ("plan", ["--devices=8", "--config.mesh.data=1", "--config.mesh.sequence=8",
              "--config.attention.sequence_strategy=ulysses"], "config.attention.sequence_strategy"),
    ("plan", ["--config.attention.implementation=cudnn"], "config.attention.implementation"),
    ("plan", ["--config.steps=0"], "config.steps"),
    ("plan", ["--search", "--devices=8", "--top=0"], "--top"),
    ("plan", ["--search", "--devices=8", "--global_batch=-4"], "--global_batch"),
    ("plan", ["--search", "--devices=8", "--seq_len=1000000000000"], "--seq_len"),
    ("plan", ["--search", "--devices=8", "--compile"], "--compile"),  # plan without --search's
    ("plan", ["--search", "--target=h100:1x8", "--devices=4"], "--devices"),
    ("plan", ["--search", "--target=h100:1x8", "--cluster=a100_80gb"], "--cluster"),
    ("plan", ["--search", "--devices=8", "--config.mesh.tensor=2"], "config.mesh.tensor"),
    ("plan", ["--search", "--devices=8", "--config.mesh.across_hosts=data"],
     "config.mesh.across_hosts"),  # the search chooses it too
    ("plan", ["--search", "--devices=8", "--config.zero_stage=3"], "config.zero_stage"),
    ("plan", ["--search", "--devices=8", "--config.pipeline.microbatches=8"],
     "config.pipeline.microbatches"),
    ("plan", ["--search", "--devices=8", "--mesh=data=²"], "--mesh"),
    ("plan", ["--search", "--devices=8", "--mesh=data=2,data=4"], "--mesh"),
    ("plan", ["--search", "--devices=8", "--cluster=nosuch"], "--cluster"),
    ("plan", ["--search", "--devices=8", "--cluster={tmp}/hf_list/config.json"], "--cluster"),
    ("plan", ["--search", "--devices=8", "--cluster={tmp}/cluster_zero_flops.json"], "--cluster"),
    ("plan", ["--search", "--devices=8", "--cluster={tmp}/cluster_text_flops.json"], "--cluster"),
    ("plan", ["--search", "--devices=8", "--cluster={tmp}/cluster_half_host.json"], "--cluster"),
    ("plan", ["--search", "--devices=8", "--cluster={tmp}/cluster_nan_memory.json"], "--cluster"),
    ("plan", ["--devices=7", "--compile"], "config.global_batch"),  # before making 7 devices
    ("plan", ["--devices=4096", "--compile", "--config.global_batch=4096"], "--devices"),
    ("train", ["--config.seq_len=3000000000"], "config.seq_len"),  # int32 positions
    ("train", ["--config.workdir={tmp}/checkpoints_file"], "config.workdir"),
    ("train", ["--config.checkpoint.restore_from={tmp}/a_file"], "config.checkpoint.restore_from"),
    ("eval", ["--workdir={tmp}/deep_run"], "--workdir"),
    ("train", ["--config.workdir={tmp}/deep_run"], "config.workdir"),
    ("import-hf", ["--from={tmp}/hf_deep", "--to={tmp}/imported"], "--from"),
    ("verify", ["--verify_steps=1000000000"], "--verify_steps"),
    ("verify", ["--verify_steps=0"], "--verify_steps"),
    ("verify", ["--config.local_sgd.inner_steps=2"], "config.local_sgd.inner_steps"),
    ("verify", [*PIPELINE, "--config.model.num_layers=3", "--config.pipeline.stage_layers=2,1",
                "--config.model.moe.num_experts=4", "--config.expert_parallel="],
     "config.pipeline.stage_layers"),
    ("schedule", ["--stages=0"], "--stages"),
    ("schedule", ["--microbatches=-3"], "--microbatches"),
    ("schedule", ["--virtual=2"], "--virtual"),  # 1f1b: one chunk per stage
    ("schedule", ["--virtual=0"], "--virtual"),
    ("schedule", ["--stages=0", "--virtual=2"], "--stages"),  # a size below 1 first
    ("schedule", ["--schedule=interleaved_1f1b", "--virtual=2", "--microbatches=6"],
     "--microbatches"),
    ("schedule", ["--microbatches=1000000"], "--microbatches"),  # would take minutes
    ("schedule", ["--stages=1000000"], "--stages"),
    ("schedule", ["--microbatches=2000", "--out={tmp}/chart.png"], "--out"),  # too many boxes
    ("schedule", ["--costs=nan,1,1"], "--costs"),
    ("schedule", ["--costs=1,inf,1"], "--costs"),
    ("schedule", ["--out={tmp}/chart.txt"], "--out"),
    ("schedule", ["--out={tmp}/hf_model"], "--out"),  # a folder
    ("schedule", ["--out="], "--out"),
    ("schedule", ["--schedule=zb"], "--schedule"),
    ("schedule", ["--backward_cost=-1"], "--backward_cost"),
    ("schedule", ["--out={tmp}/missing/chart.png"], "--out"),
    ("launch", ["--num_processes=0", "--", "train"], "--num_processes"),
    ("launch", ["--devices_per_process=-1", "--", "train"], "--devices_per_process"),
    ("launch", ["--devices_per_process=100000", "--", "train"], "--devices_per_process"),
    ("launch", ["--"], "launch"),
    ("launch", ["--num_processes=2", "--", "train", "--config.stepz=1"], "config.stepz"),
    ("launch", ["--num_processes=2", "--devices_per_process=4", "--", "train",
                "--config.mesh.data=3"], "config.mesh"),
    ("launch", ["--config.steps=3", "--", "train"], "--config.steps"),  # belongs after --
    ("launch", ["--num_processes=1000000", "--", "train"], "--num_processes"),
    ("launch", ["--", "launch", "--", "train"], "launch"),
    ("launch", ["--", "schedule"], "launch"),  # joins no job: N copies would race on --out
    ("launch", ["--", "train", "extra"], "train"),
    ("launch", ["--", "train", "--", "train"], "train"),
    ("launch", ["--", "train", "--config.distributed.num_processes=4"],
     "config.distributed.num_processes"),  # launch sets it
    ("launch", ["--", "verify", "--verify_steps=0"], "--verify_steps"),
    ("launch", ["--", "generate", "--workdir={run}", "--prompt=a", "--max_tokens=0"],
     "--max_tokens"),
    ("launch", ["--", "generate", "--workdir={run}", "--prompt=a", "--top_k=100000"], "--top_k"),
    ("launch", ["--", "export-hf", "--workdir={run}"], "--to"),
    ("launch", ["--", "eval", "--workdir={tmp}/list_run"], "--workdir"),
    ("launch", ["--", "import-hf", "--from={tmp}/hf_model", "--to={tmp}/imported"], "--from"),
    # a flag the command does not read
    ("train", ["--prompt=hi"], "--prompt"),
    ("launch", ["--", "train", "--workdir=x"], "--workdir"),
    ("schedule", ["--devices=8"], "--devices"),
    ("prepare", ["--input={tmp}/a_file", "--out={tmp}/out", "--config.steps=3"], "--config.steps"),
    ("eval", ["--workdir={run}", f"--config={REPO}/configs/tiny.py"], "--config"),
    # prepare's inputs and tokenizer
    ("prepare", ["--input={tmp}/surrogate.jsonl", "--out={tmp}/out"], "--input"),
    ("prepare", ["--input={tmp}/deep.jsonl", "--out={tmp}/out"], "--input"),
    ("prepare", ["--input={tmp}/a_file", "--out={tmp}/out", "--tokenizer=train:99999999999"],
     "--tokenizer"),
    ("prepare", ["--input={tmp}/a_file", "--out={tmp}/out", "--tokenizer=train:²"], "--tokenizer"),
    ("prepare", ["--input={tmp}/a_file", "--out={tmp}/out", "--text_field=body"], "--text_field"),
    ("prepare", ["--input={tmp}/surrogate.jsonl", "--out={tmp}/out", "--format=chat",
                 "--text_field=body"], "--text_field"),  # chat reads "messages"
    ("prepare", ["--input={tmp}/surrogate.jsonl", "--out={tmp}/out", "--split_blank_lines"],
     "--split_blank_lines"),  # JSONL documents are not split
    ("prepare", ["--input={tmp}/surrogate.jsonl", "--out={tmp}/out", "--format=chat",
                 "--split_blank_lines"], "--split_blank_lines"),
    # a run's workdir, a Hugging Face model, generate's and export-hf's flags
    ("eval", ["--workdir={tmp}/list_run"], "--workdir"),
    ("eval", ["--workdir={tmp}/garbled_run"], "--workdir"),
    ("generate", ["--workdir={run}", "--prompt=\udcff"], "--prompt"),  # not UTF-8 in argv
    ("generate", ["--workdir={run}", "--prompt=a", "--temperature=nan"], "--temperature"),
    ("generate", ["--workdir={run}", "--prompt=a", "--top_k=100000"], "--top_k"),
    ("generate", ["--workdir={run}", "--prompt=a", "--seed=-1"], "--seed"),
    ("export-hf", ["--workdir={run}", "--to={tmp}/out", "--max_shard_mb=0"], "--max_shard_mb"),
    ("import-hf", ["--from={tmp}/hf_model", "--to={tmp}/imported"], "--from"),
    ("import-hf", ["--from={tmp}/hf_list", "--to={tmp}/imported"], "--from"),
    ("import-hf", ["--from={tmp}/hf_garbled", "--to={tmp}/imported"], "--from"),
    ("import-hf", ["--from={tmp}/hf_gptq", "--to={tmp}/imported"], "--from"),  # not float8
    ("import-hf", ["--from={tmp}/hf_fp8_rows", "--to={tmp}/imported"], "--from"),  # a 1-D block
    ("import-hf", ["--from={tmp}/hf_fp8_blocks_text", "--to={tmp}/imported"], "--from"),
]


CONFIG_FILES = {
    "typo.py": "from meshtrain.config import get_config as defaults\n\n"
               "def get_config():\n  c = defaults()\n  c.stepz = 5\n  return c\n",
    "broken.py": "def get_config(:\n",
    "wrong_type.py": "from meshtrain.config import get_config as defaults\n\n"
                     "def get_config():\n  c = defaults()\n  c.steps = 'ten'\n  return c\n",
}
# Other files the cases read: JSON that parses but holds no text, broken runs and models.
HF_LLAMA = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64,
            "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
            "vocab_size": 64, "rms_norm_eps": 1e-5, "rope_theta": 10000.0}
H100 = {"peak_flops": 989e12, "hbm_bytes": 80e9, "intra_host": 450e9, "inter_host": 50e9,
        "devices_per_host": 8}  # a --cluster file
DATA_FILES = {
    "surrogate.jsonl": '{"text": "a\\ud800b"}\n',  # a lone surrogate, escaped
    "deep.jsonl": '{"text": ' + "[" * 100_000 + "]" * 100_000 + "}\n",
    "list_run/config.json": "[1]",
    "garbled_run/config.json": '{"model": "x"}',
    "hf_list/config.json": "[]",
    "hf_garbled/config.json": json.dumps(HF_LLAMA),
    "hf_garbled/model.safetensors": "not a safetensors header " * 40,
    "hf_deep/config.json": "[" * 100_000 + "]" * 100_000,
    "hf_gptq/config.json": json.dumps({**HF_LLAMA, "quantization_config": {
        "quant_method": "gptq", "bits": 4}}),
    "hf_fp8_rows/config.json": json.dumps({**HF_LLAMA, "quantization_config": {
        "quant_method": "fp8", "weight_block_size": [128]}}),
    "hf_fp8_blocks_text/config.json": json.dumps({**HF_LLAMA, "quantization_config": {
        "quant_method": "fp8", "weight_block_size": ["128", "128"]}}),
    "deep_run/config.json": "[" * 100_000 + "]" * 100_000,
    "checkpoints_file/checkpoints": "not a folder",
    **{f"cluster_{name}.json": json.dumps({**H100, **change}) for name, change in {
        "zero_flops": {"peak_flops": 0}, "text_flops": {"peak_flops": "fast"},
        "half_host": {"devices_per_host": 2.5}, "nan_memory": {"hbm_bytes": float("nan")}}.items()},
}


def test_readme_gives_the_number_of_cases():
  said = re.search(r"`tests/test_bad_input\.py`\s+runs\s+(\d+)\s+such\s+cases",
                   (REPO / "docs/bad_input.md").read_text())
  assert said, "docs/bad_input.md no longer says how many cases tests/test_bad_input.py runs"
  assert int(said[1]) == len(CASES)


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
  """A workdir with a checkpoint (step 0, the initial state: no step to compile)
  saved under the config the cases start from."""
  workdir = tmp_path_factory.mktemp("trained") / "run"
  cfg = micro_config(workdir=str(workdir))
  setup = build(cfg)
  batches = make_iterator(cfg.data, seq_len=cfg.seq_len, global_batch=cfg.global_batch,
                          vocab_size=cfg.model.vocab_size, seed=cfg.seed)
  checkpoints = Checkpoints(workdir / "checkpoints", config_key="test")
  checkpoints.save(0, setup.init_state(), batches, cfg)
  checkpoints.close()
  (workdir / "config.json").write_text(json.dumps(cfg.to_dict()))  # as train writes it
  return workdir


def tree_digest(root) -> dict[str, str]:
  """Relative path -> sha256 of each file (folders too), to compare a tree before and after."""
  return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file()
          else "folder" for p in sorted(root.rglob("*"))}


def meshtrain(command: str, args: list[str], capfd) -> tuple[int, str]:
  """Runs `meshtrain COMMAND ARGS` in this process: exit code and stderr."""
  code, _, err = cli_in_process([command, *args], capfd)
  return code, err


@pytest.mark.parametrize("command, args, key", CASES,
                         ids=[f"{c}-{' '.join(a).replace('--config.', '')}" for c, a, _ in CASES])
def test_bad_input_is_one_error_line_and_nothing_written(command, args, key, tmp_path, capfd, caplog,
                                                          request, monkeypatch):
  monkeypatch.chdir(tmp_path)
  (tmp_path / "a_file").write_text("not a folder")
  (tmp_path / "binary.bin").write_bytes(bytes(range(256)) * 8 + b"\xff\xfe")
  (tmp_path / "hf_model").mkdir()
  (tmp_path / "hf_model" / "config.json").write_text('{"model_type": "llama"}')
  for name, body in {**CONFIG_FILES, **DATA_FILES}.items():
    (tmp_path / name).parent.mkdir(exist_ok=True)
    (tmp_path / name).write_text(body)
  run = tmp_path / "run"
  if any("{run}" in arg for arg in args):
    shutil.copytree(request.getfixturevalue("trained_run"), run)
  text = request.getfixturevalue("real_text") if any("{text}" in a for a in args) else None
  args = [arg.format(tmp=tmp_path, run=run, text=text) for arg in args]
  config_file = [arg for arg in args if arg.startswith("--config=")]
  rest = [arg for arg in args if arg not in config_file]
  if command in ("train", "plan"):
    rest = [*micro_flags(workdir=run), *rest]
  before = tree_digest(tmp_path)
  code, stderr = meshtrain(command, [*config_file, *rest], capfd)
  assert code == 2, stderr
  lines = stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith(f"error: {key}: "), stderr
  assert "Traceback" not in stderr
  warned = [f"{r.name}: {r.getMessage()}" for r in caplog.records if r.levelno >= logging.WARNING]
  assert not warned, warned
  assert tree_digest(tmp_path) == before



@pytest.mark.parametrize("launched", [False, True], ids=["import-hf", "launch-import-hf"])
def test_import_checks_the_config_and_loads_its_tokenizer_once(launched, tmp_path, capfd,
                                                                monkeypatch):
  """import-hf (up to the garbled weights, read after every check) and launch
  -- import-hf (up to starting the processes) run `validate.check_config` once,
  so the config's tokenizer loads once; the imported model is checked by
  `validate.check_values`, which loads nothing."""
  monkeypatch.chdir(tmp_path)
  for name in ("hf_garbled/config.json", "hf_garbled/model.safetensors"):
    (tmp_path / name).parent.mkdir(exist_ok=True)
    (tmp_path / name).write_text(DATA_FILES[name])
  calls = collections.Counter()

  def counted(module, name):
    function = getattr(module, name)
    def wrapper(*args, **kwargs):
      calls[name] += 1
      return function(*args, **kwargs)
    monkeypatch.setattr(module, name, wrapper)
  counted(validate, "check_config")
  counted(tokenizers, "load")
  monkeypatch.setattr(launcher, "launch", lambda *args, **kwargs: 0)  # starts no process
  args = ["import-hf", "--from=hf_garbled", "--to=imported", "--config.tokenizer=bytes"]
  args = ["launch", "--", *args] if launched else args
  code, stderr = meshtrain(args[0], args[1:], capfd)
  assert calls == {"check_config": 1, "load": 1}, stderr
  if launched:
    assert (code, stderr) == (0, ""), stderr
  else:  # the weights, read after every check
    assert code == 2 and stderr.startswith("error: --from: ") and "safetensors" in stderr, stderr


@pytest.mark.parametrize("command", ["generate", "export-hf"])
def test_saved_run_commands_read_the_config_tokenizer_once(command, trained_run, tmp_path, capfd,
                                                           monkeypatch):
  """generate and export-hf load config.tokenizer in their start-up check and
  again to use it; the files are read once (the sampling itself is stubbed)."""
  monkeypatch.chdir(tmp_path)
  words = hf_tokenizers.Tokenizer(hf_tokenizers.models.WordLevel(
      {"<|endoftext|>": 0, "a": 1}, unk_token="<|endoftext|>"))
  words.pre_tokenizer = hf_tokenizers.pre_tokenizers.Whitespace()
  words.save("tokenizer.json")
  monkeypatch.setattr(generation, "from_workdir", lambda *args, **kwargs: (
      lambda prompts, *sampling: [[1] for _ in prompts]))
  tokenizers._load.cache_clear()
  own = {"generate": ["--prompt=a"], "export-hf": ["--to=exported"]}[command]
  args = [f"--workdir={trained_run}", "--config.tokenizer=tokenizer.json", *own]
  code, stderr = meshtrain(command, args, capfd)
  assert code in (0, None), stderr
  assert tokenizers._load.cache_info().misses == 1


def test_a_tokenizer_is_read_once_whichever_key_names_it_and_its_errors_name_that_key(tmp_path):
  words = hf_tokenizers.Tokenizer(hf_tokenizers.models.WordLevel(
      {"<|endoftext|>": 0, "a": 1}, unk_token="<|endoftext|>"))
  words.save(str(tmp_path / "tokenizer.json"))
  broken = tmp_path / "broken.json"
  broken.write_text("{")
  tokenizers._load.cache_clear()
  first = tokenizers.load(str(tmp_path / "tokenizer.json"), key="config.tokenizer")
  assert tokenizers.load(str(tmp_path / "tokenizer.json"), key="--tokenizer") is first
  assert tokenizers._load.cache_info().misses == 1
  for key in ("config.tokenizer", "--tokenizer"):
    with pytest.raises(ConfigError, match=f"^{key}: .*broken.json is not a Hugging Face"):
      tokenizers.load(str(broken), key=key)
