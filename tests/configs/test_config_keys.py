"""Every trainer config key is declared once.

A key is declared either by an assignment in a declaring function of `configs/packed.py` (one
that builds a group: `base_config`, `model_group`), or as a field of a dataclass that such a
function turns into a group with `declared_group(cls)` (`configs.architecture.Architecture` for the
`model` group). The checks, parsed from the source with `ast`:

1. No key is assigned twice in the declaring functions.
2. No key is both assigned and a field of the dataclass its group is built from.
3. No dataclass or NamedTuple of `train/` or `configs/` (the declaring dataclasses and their
   subclasses aside) copies a group: three or more of its fields named as keys of one group is a
   second declaration of them (what `train.data.DataSpec` was).

Each check is also run on a small source that breaks it (negative controls), so that a checker
that finds nothing cannot pass.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib

from configs import packed
from support import paths

REPO = paths.REPO
CONFIG = REPO / "configs" / "packed.py"
# Fields named as keys of one group from which a dataclass counts as a copy of that group.
COPY_THRESHOLD = 3


def _chain(node: ast.AST) -> list[str] | None:
  """`c.data.source` -> ["c", "data", "source"]; None for anything else."""
  parts = []
  while isinstance(node, ast.Attribute):
    parts.append(node.attr)
    node = node.value
  if not isinstance(node, ast.Name):
    return None
  return [node.id] + parts[::-1]


def _declared_class(call: ast.AST) -> str | None:
  """`declared_group(architecture.Architecture)` -> "architecture.Architecture"."""
  if (isinstance(call, ast.Call) and isinstance(call.func, ast.Name)
      and call.func.id == "declared_group" and len(call.args) == 1):
    return ast.unparse(call.args[0])
  return None


@dataclasses.dataclass
class Declarations:
  """What the declaring functions of a config module declare."""

  assigned: list[str]  # dotted keys, in order, duplicates kept
  built: dict[str, str]  # group prefix ("model.") -> the dataclass it is built from


def declarations(source: str) -> Declarations:
  """The keys assigned by the declaring functions of `source` (a config module), with the
  groups' prefixes resolved through calls of the module's own functions (`c.model =
  model_group()` puts `model_group`'s keys under "model.")."""
  functions = {f.name: f for f in ast.parse(source).body if isinstance(f, ast.FunctionDef)}
  assigned, built = [], {}

  def walk(name: str, prefix: str) -> None:
    for node in ast.walk(functions[name]):
      if not isinstance(node, ast.Assign) or len(node.targets) != 1:
        continue
      target, value = _chain(node.targets[0]), node.value
      if isinstance(node.targets[0], ast.Name) and _declared_class(value):
        built[prefix] = _declared_class(value)
      if target is None or len(target) < 2:
        continue
      key = prefix + ".".join(target[1:])
      if (isinstance(value, ast.Call) and isinstance(value.func, ast.Name)
          and value.func.id in functions):
        walk(value.func.id, key + ".")
      elif _declared_class(value):
        built[key + "."] = _declared_class(value)
      elif not (isinstance(value, ast.Call) and ast.unparse(value.func).endswith("ConfigDict")):
        assigned.append(key)

  walk("base_config", "")
  return Declarations(assigned=assigned, built=built)


def _fields(dotted_class: str) -> list[str]:
  """The field names of a dataclass named as written in configs/packed.py, nested groups
  flattened ("rope_scaling.type")."""
  module_name, class_name = dotted_class.rsplit(".", 1)
  cls = getattr(getattr(packed, module_name), class_name)
  out = []
  for field in dataclasses.fields(cls):
    default = (field.default_factory() if field.default is dataclasses.MISSING
               else field.default)
    if dataclasses.is_dataclass(default):
      out += [f"{field.name}.{name}" for name in _fields_of(type(default))]
    else:
      out.append(field.name)
  return out


def _fields_of(cls: type) -> list[str]:
  return [f.name for f in dataclasses.fields(cls)]


def twice_assigned(decl: Declarations) -> list[str]:
  """Check 1: keys assigned more than once."""
  return sorted({key for key in decl.assigned if decl.assigned.count(key) > 1})


def assigned_and_built(decl: Declarations, fields=_fields) -> list[str]:
  """Check 2: keys assigned although their group's dataclass declares them."""
  out = []
  for prefix, dotted_class in decl.built.items():
    names = {prefix + name for name in fields(dotted_class)}
    out += [key for key in decl.assigned if key in names]
  return sorted(out)


def group_copies(source: str, groups: dict[str, set[str]], exempt: set[str]) -> list[str]:
  """Check 3: dataclasses / NamedTuples of `source` with `COPY_THRESHOLD` or more fields named
  as keys of one group (`groups`: group -> its leaf names); classes in `exempt` (and classes
  deriving from them) are the declarations themselves."""
  out = []
  for node in ast.walk(ast.parse(source)):
    if not isinstance(node, ast.ClassDef) or node.name in exempt:
      continue
    if any(ast.unparse(b).split(".")[-1] in exempt for b in node.bases):
      continue
    decorated = any("dataclass" in ast.unparse(d) for d in node.decorator_list)
    if not (decorated or any(ast.unparse(b).endswith("NamedTuple") for b in node.bases)):
      continue
    names = {s.target.id for s in node.body
             if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)}
    for group, keys in groups.items():
      if len(names & keys) >= COPY_THRESHOLD:
        out.append(f"{node.name} copies {group}: {sorted(names & keys)}")
  return out


def _groups() -> dict[str, set[str]]:
  """Group -> the leaf names of its keys, from the built config itself."""
  out = {}
  for group, value in packed.base_config().items():
    out[group] = {k for k, v in value.items() if not hasattr(v, "items")}
  return out


def test_no_key_is_assigned_twice():
  assert twice_assigned(declarations(CONFIG.read_text())) == []


def test_no_key_is_assigned_beside_the_dataclass_that_declares_it():
  decl = declarations(CONFIG.read_text())
  assert decl.built == {"model.": "architecture.Architecture"}
  assert assigned_and_built(decl) == []


def test_the_parse_finds_every_key_the_config_has():
  """The parse is what the config holds: assigned keys plus the dataclass fields are exactly
  the config's leaves (a parse that misses keys would make checks 1 and 2 pass vacuously)."""
  decl = declarations(CONFIG.read_text())
  parsed = set(decl.assigned)
  for prefix, dotted_class in decl.built.items():
    parsed |= {prefix + name for name in _fields(dotted_class)}

  def leaves(group, prefix=""):
    for key, value in group.items():
      if hasattr(value, "items"):
        yield from leaves(value, prefix + key + ".")
      else:
        yield prefix + key

  assert parsed == set(leaves(packed.base_config()))


def test_no_dataclass_of_the_trainer_copies_a_config_group():
  # Architecture and RopeScaling declare the model group; Sampling is the sampler's own argument
  # (train.sample's flags, the rollout engine's), which rl.temperature, top_k, top_p resolve into.
  exempt = {"Architecture", "RopeScaling", "Sampling"}
  found = []
  for path in sorted(list((REPO / "train").rglob("*.py")) + list((REPO / "configs").rglob("*.py"))):
    found += [f"{path.relative_to(REPO)}: {c}"
              for c in group_copies(path.read_text(), _groups(), exempt)]
  assert found == []


def test_negative_controls_each_check_catches_its_mistake():
  twice = declarations(
      "def base_config():\n  c = ml_collections.ConfigDict()\n"
      "  c.train = ml_collections.ConfigDict()\n  c.train.seed = 0\n  c.train.seed = 1\n")
  assert twice_assigned(twice) == ["train.seed"]

  beside = declarations(
      "def model_group():\n  m = declared_group(architecture.Architecture)\n"
      "  m.d_model = 128\n  m.init_from = None\n  return m\n"
      "def base_config():\n  c = ml_collections.ConfigDict()\n  c.model = model_group()\n")
  assert beside.assigned == ["model.d_model", "model.init_from"]
  assert assigned_and_built(beside) == ["model.d_model"]

  spec = ("import dataclasses\n@dataclasses.dataclass(frozen=True)\nclass DataSpec:\n"
          "  seq_len: int\n  strategy: str\n  long_docs: str\n  seed: int\n")
  assert group_copies(spec, _groups(), exempt=set()) == [
      "DataSpec copies packing: ['long_docs', 'seq_len', 'strategy']"]
  # The pre-refactor DecoderConfig re-declared the model group's fields beside the config.
  decoder = ("@dataclasses.dataclass(frozen=True)\nclass DecoderConfig:\n  vocab_size: int\n"
             "  num_layers: int = 4\n  d_model: int = 256\n  num_heads: int = 4\n")
  assert len(group_copies(decoder, _groups(), exempt=set())) == 1
  # ... and deriving from the declaration is not a copy.
  derived = decoder.replace("class DecoderConfig:", "class DecoderConfig(Architecture):")
  assert group_copies(derived, _groups(), exempt={"Architecture"}) == []


def test_the_model_group_and_decoder_config_are_the_architecture_fields():
  """The declaration reaches both ends: the config's model group and `DecoderConfig`."""
  architecture = importlib.import_module("configs.architecture")
  model = importlib.import_module("train.model.config")
  fields = set(_fields_of(architecture.Architecture))
  assert fields <= set(packed.base_config().model.keys())
  assert set(packed.base_config().model.keys()) - fields == {"init_from", "init_adapter"}
  assert fields <= set(_fields_of(model.DecoderConfig))
  assert issubclass(model.DecoderConfig, architecture.Architecture)
