import jax
from jax.sharding import PartitionSpec as P

from conftest import micro_config
from meshtrain import rules as r
from meshtrain.mesh import AXES, make_mesh
from meshtrain.train.state import llama_spec, model_config


def test_composition_concatenates_in_mesh_order():
  table = dict(r.compose(r.AXIS_RULES["fsdp"], r.AXIS_RULES["data"]))
  assert table[r.BATCH] == ("data", "fsdp")
  assert table[r.EMBED] == ("fsdp",)


def test_names_without_a_rule_are_replicated_and_axes_used_once():
  rules = r.compose({"a": "fsdp", "b": ("fsdp", "tensor")})
  assert r.logical_to_spec(("a", "unknown", None), rules) == P("fsdp", None, None)
  assert r.logical_to_spec(("a", "b"), rules) == P("fsdp", "tensor")


def test_strategy_uses_only_axes_larger_than_one():
  mesh = make_mesh({**{a: 1 for a in AXES}, "data": 4, "tensor": 2})
  table = dict(r.strategy_rules(mesh).params)
  assert table[r.BATCH] == ("data",)
  assert table[r.MLP] == ("tensor",)
  assert r.EMBED not in table  # no fsdp: weights stay whole


def test_replicated_share_reports_unsharded_weights():
  spec = llama_spec(model_config(micro_config()))
  fsdp = make_mesh({**{a: 1 for a in AXES}, "fsdp": 8})
  share = r.replicated_share(spec.abstract_params, spec.names, fsdp, r.strategy_rules(fsdp).params)
  norm_bytes = 4 * 32 * (2 * 2 + 1)  # two norms per layer, two layers, the final norm
  total_bytes = 4 * sum(x.size for x in jax.tree.leaves(spec.abstract_params))
  assert share == {"fsdp": norm_bytes / total_bytes}
  data = make_mesh({**{a: 1 for a in AXES}, "data": 8})
  assert r.replicated_share(spec.abstract_params, spec.names, data, r.strategy_rules(data).params) == {}
