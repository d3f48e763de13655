"""Which Hugging Face tensor each meshtrain weight is, and how their layouts relate.

meshtrain keeps the layers' weights stacked on a leading `layers` axis (and an
MoE layer's experts on an `experts` axis after it) and splits heads from
head_dim (`wq_DxNxH`); Hugging Face keeps one `[out, in]` matrix per layer,
projection and expert (`q_proj.weight` is [N*H, D]). Every meshtrain weight of
one layer (and expert) is a reshape of an HF tensor, transposed or not: its
first `split` dimensions flatten to the matrix's (transposed) rows, the rest
to its columns; a bias or norm scale is a vector. Both layouts use the
rotate-half RoPE, so no head permutation is needed.

Expert weights come in two layouts on disk. One tensor per expert
(`block_sparse_moe.experts.N.w1` for Mixtral, `mlp.experts.N.gate_proj` for
Qwen3-MoE and Qwen2-MoE) is what the published checkpoints hold and what
transformers' `save_pretrained` writes (v4 and v5 alike); meshtrain reads and
writes it.
transformers v5 keeps the experts fused in memory (`mlp.experts.gate_up_proj`
[E, 2F, D], `mlp.experts.down_proj` [E, D, F]); checkpoints saved in that
layout are read too (`FusedExperts`).

DeepSeek-V3's multi-token prediction modules (`mtp`, stacked on their own
leading axis) are the checkpoint's layers `num_hidden_layers` onward: each
one's block under the names of a layer, its norms and projection beside them
(`enorm`, `hnorm`, `eh_proj`, `shared_head.norm`), and copies of the shared
embedding and output head (`embed_tokens`, `shared_head.head`), which the
import leaves unread, as transformers does, and the export writes (`mtp_copies`).
"""

import dataclasses
import itertools
import math
from collections.abc import Callable, Iterator

import numpy as np

Reader = Callable[[tuple[slice, ...]], np.ndarray]  # a block of one HF tensor


@dataclasses.dataclass(frozen=True)
class Weight:
  """One HF tensor per layer (and per expert) of a meshtrain weight."""
  hf_name: str      # "{layer}" and "{expert}" stand for the indices of the stacked dims
  transpose: bool   # meshtrain's per-tensor weight is a reshape of the HF matrix transposed
  split: int        # meshtrain dims that flatten to the (transposed) matrix's rows
  first_layer: int = 0  # the HF index of the stack's first layer

  @property
  def stacked_dims(self) -> int:
    """meshtrain's leading dims that index separate HF tensors (layers, experts)."""
    return ("{layer}" in self.hf_name) + ("{expert}" in self.hf_name)

  def names(self, shape: tuple[int, ...]) -> Iterator[tuple[tuple[int, ...], str]]:
    """(leading index, HF name) of every HF tensor of a meshtrain weight of `shape`."""
    for lead in itertools.product(*map(range, shape[:self.stacked_dims])):
      fields = dict(zip(("layer", "expert") if "{layer}" in self.hf_name else ("expert",), lead))
      if "layer" in fields:
        fields["layer"] += self.first_layer
      yield lead, self.hf_name.format(**fields)

  def hf_shape(self, inner_shape: tuple[int, ...]) -> tuple[int, ...]:
    """The HF tensor's shape for meshtrain's per-tensor shape."""
    rows, cols = math.prod(inner_shape[:self.split]), math.prod(inner_shape[self.split:])
    if self.split == len(inner_shape):
      return (rows,)
    return (cols, rows) if self.transpose else (rows, cols)

  def read(self, read_hf: Reader, inner_shape: tuple[int, ...],
           index: tuple[slice, ...]) -> np.ndarray:
    """meshtrain's `weight[index]` of one HF tensor, reading only the rows and
    columns it covers (`read_hf(hf_index)` reads a block)."""
    groups = [inner_shape[:self.split], inner_shape[self.split:]]
    group_index = [index[:self.split], index[self.split:]]
    hf_index, block_shape, inner_index = [], [], []
    for dims, idx in zip(groups, group_index):
      if not dims:
        continue
      start, stop, _ = idx[0].indices(dims[0])
      inner = math.prod(dims[1:])
      hf_index.append(slice(start * inner, stop * inner))
      block_shape += [stop - start, *dims[1:]]
      inner_index += [slice(None), *idx[1:]]
    if self.transpose:
      block = read_hf(tuple(reversed(hf_index))).T
    else:
      block = read_hf(tuple(hf_index))
    return block.reshape(block_shape)[tuple(inner_index)]

  def to_hf(self, inner: np.ndarray) -> np.ndarray:
    """meshtrain's per-tensor weight as the HF tensor."""
    shape = self.hf_shape(inner.shape)
    matrix = inner.reshape(shape[::-1] if self.transpose else shape)
    return np.ascontiguousarray(matrix.T if self.transpose else matrix)


@dataclasses.dataclass(frozen=True)
class FusedExperts:
  """An expert weight read from transformers v5's fused layout, one tensor per
  layer: meshtrain's [E, A, B] is `hf[:, offset:offset + B, :]` transposed
  to [E, A, B], the HF tensor [E, parts x B, A] (gate and up: parts 2, offset
  0 and B; down: parts 1)."""
  hf_name: str
  parts: int
  part: int
  first_layer: int = 0
  stacked_dims = 1

  names = Weight.names

  def hf_shape(self, inner_shape: tuple[int, ...]) -> tuple[int, ...]:
    experts, a, b = inner_shape
    return (experts, self.parts * b, a)

  def read(self, read_hf: Reader, inner_shape: tuple[int, ...],
           index: tuple[slice, ...]) -> np.ndarray:
    b = inner_shape[2]
    start, stop, _ = index[2].indices(b)
    rows = slice(self.part * b + start, self.part * b + stop)
    return read_hf((index[0], rows, index[1])).transpose(0, 2, 1)


_ATTENTION = {
    "attn/wq_DxNxH": Weight("self_attn.q_proj.weight", True, 1),
    "attn/wk_DxKxH": Weight("self_attn.k_proj.weight", True, 1),
    "attn/wv_DxKxH": Weight("self_attn.v_proj.weight", True, 1),
    "attn/wo_NxHxD": Weight("self_attn.o_proj.weight", True, 2),
    "attn/bq_NxH": Weight("self_attn.q_proj.bias", False, 2),
    "attn/bk_KxH": Weight("self_attn.k_proj.bias", False, 2),
    "attn/bv_KxH": Weight("self_attn.v_proj.bias", False, 2),
    "attn/q_norm/scale": Weight("self_attn.q_norm.weight", False, 1),
    "attn/k_norm/scale": Weight("self_attn.k_norm.weight", False, 1),
    "attn_norm/scale": Weight("input_layernorm.weight", False, 1),
    "mlp_norm/scale": Weight("post_attention_layernorm.weight", False, 1),
    "mlp/w_gate_DxF": Weight("mlp.gate_proj.weight", True, 1),
    "mlp/w_up_DxF": Weight("mlp.up_proj.weight", True, 1),
    "mlp/w_down_FxD": Weight("mlp.down_proj.weight", True, 1),
}
# DeepSeek's Multi-head Latent Attention (`models/mla.py`; without a query
# latent, its queries are `attn/wq_DxNxH`, as in every other family) and shared experts.
_DEEPSEEK = {
    "attn/wq_down_DxR": Weight("self_attn.q_a_proj.weight", True, 1),
    "attn/q_latent_norm/scale": Weight("self_attn.q_a_layernorm.weight", False, 1),
    "attn/wq_up_RxNxH": Weight("self_attn.q_b_proj.weight", True, 1),
    "attn/wkv_down_DxC": Weight("self_attn.kv_a_proj_with_mqa.weight", True, 1),
    "attn/kv_latent_norm/scale": Weight("self_attn.kv_a_layernorm.weight", False, 1),
    "attn/wkv_up_CxNxH": Weight("self_attn.kv_b_proj.weight", True, 1),
    "mlp/shared/w_gate_DxF": Weight("mlp.shared_experts.gate_proj.weight", True, 1),
    "mlp/shared/w_up_DxF": Weight("mlp.shared_experts.up_proj.weight", True, 1),
    "mlp/shared/w_down_FxD": Weight("mlp.shared_experts.down_proj.weight", True, 1),
}
# DeepSeek-V3's router's selection bias: model state, not a weight.
_SELECTION_BIAS = {"mlp/bias_E": Weight("mlp.gate.e_score_correction_bias", False, 1)}
# Per family: the router, then the experts' gate, up and down projections.
_QWEN_EXPERTS = ("mlp.gate.weight", "mlp.experts.{expert}.gate_proj.weight",
                 "mlp.experts.{expert}.up_proj.weight", "mlp.experts.{expert}.down_proj.weight")
_EXPERTS = {
    "mixtral": ("block_sparse_moe.gate.weight", "block_sparse_moe.experts.{expert}.w1.weight",
                "block_sparse_moe.experts.{expert}.w3.weight",
                "block_sparse_moe.experts.{expert}.w2.weight"),
    "qwen3_moe": _QWEN_EXPERTS,
    "qwen2_moe": _QWEN_EXPERTS,
    "deepseek_v2": _QWEN_EXPERTS,
    "deepseek_v3": _QWEN_EXPERTS,
}
# Qwen2-MoE's shared expert, and the gate of its output.
_SHARED_EXPERT = {
    "mlp/shared/w_gate_DxF": Weight("mlp.shared_expert.gate_proj.weight", True, 1),
    "mlp/shared/w_up_DxF": Weight("mlp.shared_expert.up_proj.weight", True, 1),
    "mlp/shared/w_down_FxD": Weight("mlp.shared_expert.down_proj.weight", True, 1),
    "mlp/shared_gate_Dx1": Weight("mlp.shared_expert_gate.weight", True, 1),
}
# A multi-token prediction module's own weights (its block's are a layer's),
# per family that has them; and the copies of the shared embedding and head
# that the checkpoint keeps with each module.
_MTP = {"deepseek_v3": {
    "mtp/embed_norm/scale": Weight("enorm.weight", False, 1),
    "mtp/hidden_norm/scale": Weight("hnorm.weight", False, 1),
    "mtp/proj_2DxD": Weight("eh_proj.weight", True, 1),
    "mtp/norm/scale": Weight("shared_head.norm.weight", False, 1),
}}
_MTP_COPIES = {"embed/embedding_VxD": Weight("embed_tokens.weight", False, 1),
               "head/head_DxV": Weight("shared_head.head.weight", True, 1)}
FUSED_ROUTER, FUSED_GATE_UP, FUSED_DOWN = ("mlp.gate.weight", "mlp.experts.gate_up_proj",
                                           "mlp.experts.down_proj")
_LAYER = "model.layers.{layer}."


def hf_weights(family: str, first_dense_layers: int = 0, fused_experts: bool = False,
               num_layers: int = 0) -> dict[str, Weight | FusedExperts]:
  """meshtrain parameter (and model state) path -> its Hugging Face tensors,
  for a model of `family` (a `model_type`) whose first `first_dense_layers`
  layers are the `dense_layers` stack; with `fused_experts`, the experts as
  transformers v5 fuses them. The multi-token prediction modules (`mtp`,
  where the family has them) are the HF layers from `num_layers` (the
  model's) on. Paths a model does not have are simply not looked up."""
  weights = {"embed/embedding_VxD": Weight("model.embed_tokens.weight", False, 1),
             "head/final_norm/scale": Weight("model.norm.weight", False, 1),
             "head/head_DxV": Weight("lm_head.weight", True, 1)}
  shared = {"qwen2_moe": _SHARED_EXPERT, "deepseek_v2": _DEEPSEEK,
            "deepseek_v3": {**_DEEPSEEK, **_SELECTION_BIAS}}.get(family, {})
  layer = {key: dataclasses.replace(w, hf_name=_LAYER + w.hf_name)
           for key, w in {**_ATTENTION, **shared}.items()}
  if family in _EXPERTS:
    router, gate, up, down = _EXPERTS[family]
    experts = {"mlp/w_gate_ExDxF": Weight(_LAYER + gate, True, 1),
               "mlp/w_up_ExDxF": Weight(_LAYER + up, True, 1),
               "mlp/w_down_ExFxD": Weight(_LAYER + down, True, 1)}
    if fused_experts:
      router = FUSED_ROUTER
      experts = {"mlp/w_gate_ExDxF": FusedExperts(_LAYER + FUSED_GATE_UP, 2, 0),
                 "mlp/w_up_ExDxF": FusedExperts(_LAYER + FUSED_GATE_UP, 2, 1),
                 "mlp/w_down_ExFxD": FusedExperts(_LAYER + FUSED_DOWN, 1, 0)}
    layer.update(experts, **{"mlp/router_DxE": Weight(_LAYER + router, True, 1)})
  stacks = {"dense_layers": 0, "layers": first_dense_layers}
  mtp = _MTP.get(family, {})
  if mtp:  # each module's block: a layer
    stacks["mtp/block"] = num_layers
  for stack, first in stacks.items():
    weights.update({f"{stack}/{key}": dataclasses.replace(w, first_layer=first)
                    for key, w in layer.items()})
  weights.update({key: dataclasses.replace(w, hf_name=_LAYER + w.hf_name, first_layer=num_layers)
                  for key, w in mtp.items()})
  return weights


def mtp_copies(num_layers: int, mtp_layers: int) -> dict[str, list[Weight]]:
  """meshtrain path -> the copies of it that DeepSeek-V3's checkpoint keeps
  with each of its `mtp_layers` multi-token prediction modules (layers
  `num_layers` on): the embedding and the output head, written by the export
  as the published checkpoint has them. No import reads them."""
  return {path: [dataclasses.replace(w, hf_name=f"model.layers.{num_layers + k}.{w.hf_name}")
                 for k in range(mtp_layers)] for path, w in _MTP_COPIES.items()}
