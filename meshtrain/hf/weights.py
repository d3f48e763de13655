"""Which Hugging Face tensor each meshtrain weight is, and how their layouts relate.

meshtrain keeps the layers' weights stacked on a leading `layers` axis and
splits heads from head_dim (`wq_DxNxH`); Hugging Face keeps one `[out, in]`
matrix per layer and projection (`q_proj.weight` is [N*H, D]). Every meshtrain
weight of one layer is a reshape of an HF matrix, transposed or not: its first
`split` dimensions flatten to the matrix's (transposed) rows, the rest to its
columns. Both layouts use the rotate-half RoPE, so no head permutation is needed.
"""

import dataclasses
import math
from collections.abc import Callable

import numpy as np


@dataclasses.dataclass(frozen=True)
class Weight:
  hf_name: str      # "{layer}" stands for the layer index in stacked weights
  transpose: bool   # meshtrain's per-layer weight is a reshape of the HF matrix transposed
  split: int        # meshtrain dims that flatten to the (transposed) matrix's rows

  @property
  def stacked(self) -> bool:
    return "{layer}" in self.hf_name

  def hf_names(self, num_layers: int) -> list[str]:
    return ([self.hf_name.format(layer=i) for i in range(num_layers)] if self.stacked
            else [self.hf_name])

  def hf_shape(self, layer_shape: tuple[int, ...]) -> tuple[int, ...]:
    """The HF tensor's shape for meshtrain's per-layer shape."""
    rows, cols = math.prod(layer_shape[:self.split]), math.prod(layer_shape[self.split:])
    if len(layer_shape) == 1:
      return (rows,)
    return (cols, rows) if self.transpose else (rows, cols)

  def read(self, read_hf: Callable[[tuple[slice, ...]], np.ndarray],
           layer_shape: tuple[int, ...], index: tuple[slice, ...]) -> np.ndarray:
    """meshtrain's `layer[index]`, reading from the HF tensor only the rows and
    columns it covers (`read_hf(hf_index)` reads a block)."""
    groups = [layer_shape[:self.split], layer_shape[self.split:]]
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

  def to_hf(self, layer: np.ndarray) -> np.ndarray:
    """meshtrain's per-layer weight as the HF tensor."""
    shape = self.hf_shape(layer.shape)
    matrix = layer.reshape(shape[::-1] if self.transpose else shape)
    return np.ascontiguousarray(matrix.T if self.transpose else matrix)


_LAYER = "model.layers.{layer}."
# meshtrain parameter path -> its Hugging Face tensor.
WEIGHTS = {
    "embed/embedding_VxD": Weight("model.embed_tokens.weight", False, 1),
    "head/final_norm/scale": Weight("model.norm.weight", False, 1),
    "head/head_DxV": Weight("lm_head.weight", True, 1),
    "layers/attn/wq_DxNxH": Weight(_LAYER + "self_attn.q_proj.weight", True, 1),
    "layers/attn/wk_DxKxH": Weight(_LAYER + "self_attn.k_proj.weight", True, 1),
    "layers/attn/wv_DxKxH": Weight(_LAYER + "self_attn.v_proj.weight", True, 1),
    "layers/attn/wo_NxHxD": Weight(_LAYER + "self_attn.o_proj.weight", True, 2),
    "layers/attn_norm/scale": Weight(_LAYER + "input_layernorm.weight", False, 1),
    "layers/mlp/w_gate_DxF": Weight(_LAYER + "mlp.gate_proj.weight", True, 1),
    "layers/mlp/w_up_DxF": Weight(_LAYER + "mlp.up_proj.weight", True, 1),
    "layers/mlp/w_down_FxD": Weight(_LAYER + "mlp.down_proj.weight", True, 1),
    "layers/mlp_norm/scale": Weight(_LAYER + "post_attention_layernorm.weight", False, 1),
}
