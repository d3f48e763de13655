import jax
import pytest
from jax.sharding import PartitionSpec as P

from conftest import micro_config
from meshtrain import rules as r
from meshtrain.errors import ConfigError
from meshtrain.mesh import AXES, make_mesh
from meshtrain.train.parallelize import llama_spec, model_config


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


def mesh_of(**sizes):
  return make_mesh({**{a: 1 for a in AXES}, **sizes})


def test_a_models_own_names_join_every_table_of_the_strategy():
  zero1 = r.strategy_rules(mesh_of(data=2, fsdp=2, tensor=2), zero_stage=1)
  rules = r.with_names(zero1, {"kv": "heads", "width": "embed", "hidden": ("fsdp", "tensor"),
                               "embed": None})
  params, optimizer = dict(rules.params), dict(rules.optimizer)
  assert params["kv"] == ("tensor",) and params["hidden"] == ("fsdp", "tensor")
  # An alias follows its target through the tables: ZeRO-1 adds `data` to the
  # optimizer state's embed, so also to the alias's.
  assert params["width"] == ("fsdp",) and optimizer["width"] == ("data", "fsdp")
  assert params["embed"] == ()
  assert r.logical_to_spec(("embed", "kv"), rules.params) == P(None, "tensor")
  with pytest.raises(ConfigError, match=r"rules\['kv'\]: 'head' is neither a mesh axis"):
    r.with_names(zero1, {"kv": "head"})


def test_mesh_axis_names_are_honoured_as_their_axes():
  rules = r.strategy_rules(mesh_of(fsdp=4, tensor=2)).params
  assert r.logical_to_spec(("tensor", "fsdp"), rules) == P("tensor", "fsdp")
  assert r.logical_to_spec((("data", "fsdp"), None), rules) == P(("data", "fsdp"), None)
  # Mixed with logical names, an axis is still used once.
  assert r.logical_to_spec(("embed", "fsdp", "mlp"), rules) == P("fsdp", None, "tensor")


def test_layout_check_names_the_weight_its_shape_and_names():
  mesh = mesh_of(fsdp=4, tensor=2)
  rules = r.strategy_rules(mesh)
  params = {"attn": {"kernel": jax.ShapeDtypeStruct((4, 64, 256), "float32")}}
  with pytest.raises(ConfigError, match=r"attn/kernel: shape \(4, 64, 256\) has 3 dimensions but "
                     r"its annotation names 2: \('embed', 'kv'\)"):
    r.check_layout(params, {"attn": {"kernel": ("embed", "kv")}}, mesh, rules)
  with pytest.raises(ConfigError, match=r"attn/kernel: dimension 0 \('embed'\) of shape "
                     r"\(6, 64, 256\).* does not split over fsdp = 4 devices"):
    r.check_layout({"attn": {"kernel": jax.ShapeDtypeStruct((6, 64, 256), "float32")}},
                   {"attn": {"kernel": ("embed", None, "mlp")}}, mesh, rules)
  r.check_layout(params, {"attn": {"kernel": ("embed", None, "mlp")}}, mesh, rules)


def test_unknown_names_are_listed_with_their_weights():
  names = {"a": {"kernel": ("embed", "kv")}, "b": {"kernel": ("kv", ("fsdp", "q"))}}
  assert r.unknown_names(names, r.strategy_rules(mesh_of(fsdp=8)).params) == {
      "kv": ["a/kernel", "b/kernel"], "q": ["b/kernel"]}


def test_layout_changes_name_each_reordered_or_dropped_axis():
  """What `logical_to_spec` changes is reported per annotation: axes asked in
  another order (`P(('tensor', 'fsdp'))`), an axis an earlier dimension took."""
  mesh = make_mesh({**{a: 1 for a in AXES}, "fsdp": 4, "tensor": 2})
  rules = r.compose({"a": "fsdp", "b": "tensor"})
  names = {"w": (("tensor", "fsdp"), None), "x": ("a", "a"), "y": ("a", "b"),
           "z": ("a", ("b", "sequence"))}  # sequence has size 1: no split asked
  assert r.logical_to_spec(names["w"], rules) == P(("fsdp", "tensor"), None)
  assert r.layout_changes(names, mesh, rules) == [
      "w (('tensor', 'fsdp'), None): dimension 0 (('tensor', 'fsdp')) splits over "
      "('fsdp', 'tensor') in mesh order, not ('tensor', 'fsdp')",
      "x ('a', 'a'): dimension 1 (a) is not split over 'fsdp', which an earlier dimension uses"]
