"""Every command in a ```bash block of README.md and docs/*.md names what exists: the module
`python -m` runs, the config file and variant of `train.main` and every `--config.KEY` it sets,
and each `--flag` of a command whose parser can be built (`build_parser`, `segpack`'s
subcommands). The README's own blocks are also run end to end by the tests they name; this
catches a renamed key or flag in every other block before a reader does."""

import importlib
import importlib.util

import pytest

from support import doc_blocks
from support import paths

REPO = paths.REPO
# `python -m MODULE` -> (module, function) of its argparse parser, for the flags check.
PARSERS = {"train.export": ("train.export.command", "build_parser"),
           "train.bench.adapters": ("train.bench.adapters", "build_parser"),
           "train.bench.memory": ("train.bench.memory", "build_parser"),
           "train.bench.hf_import": ("train.bench.hf_import", "build_parser")}

SEGPACK = {"tokenize": ("segpack.cli.tokenize", "_parser"),
           "stats": ("segpack.cli.stats", "build_parser")}


def commands() -> list[tuple[str, list[str]]]:
  """`(where, argv after "python -m")` of every `python -m` command of a bash block
  (support/doc_blocks.py: continuations joined, comments left out; `NAME=VALUE` words, `time`
  and a `pip install ... &&` before it skipped; placeholders such as `...` left as they are)."""
  out = []
  for block in doc_blocks.blocks():
    if block.language != "bash":
      continue
    for line in block.commands():
      try:
        argv, _ = doc_blocks.python_m(line)
      except ValueError:  # a line of a multi-line string
        continue
      if argv:
        out.append((f"{block.doc}: {line[:80]}", argv))
  return out


def _config_keys(config, prefix=""):
  keys = set()
  for name, value in config.items():
    keys.add(prefix + name)
    if hasattr(value, "items"):
      keys |= _config_keys(value, prefix + name + ".")
  return keys


def _check_train_main(where, argv):
  spec = next((a.split("=", 1)[1] for a in argv if a.startswith("--config=")), None)
  assert spec, f"{where}: no --config="
  file, _, variant = spec.partition(":")
  assert (REPO / file).is_file(), f"{where}: {file} does not exist"
  module = importlib.import_module(file.removesuffix(".py").replace("/", "."))
  keys = _config_keys(module.get_config(variant or None))
  for arg in argv:
    if arg.startswith("--config."):
      key = arg[len("--config."):].split("=", 1)[0]
      assert key in keys, f"{where}: --config.{key} is no key of {spec}"


def test_every_documented_command_names_what_exists():
  found = commands()
  assert len(found) > 40  # the blocks were read
  for where, argv in found:
    module = argv[0]
    assert importlib.util.find_spec(module) is not None, f"{where}: no module {module}"
    if module == "train.main":
      _check_train_main(where, argv)
    elif module == "segpack" and argv[1:2] in (["tokenize"], ["stats"]):
      _check_parses(where, *SEGPACK[argv[1]], argv[2:])
    elif module in PARSERS:
      _check_parses(where, *PARSERS[module], argv[1:])


def _check_parses(where, name, function, args):
  """`args` parse with the command's own parser, every flag known (placeholders such as `...`
  and `DIR` are values, which parse)."""
  module = importlib.import_module(name)
  if hasattr(module, "join_beam_options"):
    args = module.join_beam_options(args)
  try:
    _, unknown = getattr(module, function)().parse_known_args(args)
  except SystemExit as e:
    raise AssertionError(f"{where}: does not parse ({e})") from e
  assert not [a for a in unknown if a.startswith("-")], f"{where}: unknown flags {unknown}"


def test_a_renamed_key_or_a_missing_module_is_caught():
  """The negative control: the checks refuse what a stale block would say."""
  with pytest.raises(AssertionError, match="is no key"):
    _check_train_main("x", ["--config=configs/packed.py", "--config.model.lora.rnak=16"])
  with pytest.raises(AssertionError, match="does not exist"):
    _check_train_main("x", ["--config=configs/nope.py"])
  with pytest.raises(AssertionError, match="unknown flags"):
    _check_parses("x", "train.export.command", "build_parser",
                  ["--workdir", "W", "--output", "O", "--adaptor"])
  with pytest.raises(AssertionError, match="unknown flags"):
    _check_parses("x", "segpack.cli.tokenize", "_parser",
                  ["--input", "a", "--output", "b", "--formatt", "chat"])
  _check_parses("x", "train.export.command", "build_parser",
                ["--workdir", "W", "--output", "O", "--adapter"])
