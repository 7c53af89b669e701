"""A run's chat template, one answer for `train.sample --chat` and `train.export`
(`train.runs.tokenizer.chat_renderer`), and the one rule of a directory holding a chat template
(`segpack.text.chat.hf_chat.has_template`).

Oracles: the template text written into the directory (transformers renders it); a mixture's
refusal is compared, character for character, between the sampler and the export.
"""

import json
import shutil

import pytest

transformers = pytest.importorskip("transformers")

from configs import packed  # noqa: E402
from segpack.text import chat  # noqa: E402
from segpack.text.chat import hf_chat  # noqa: E402
from support import chat_datasets  # noqa: E402
from train.export import files as export_files  # noqa: E402
from train.export import tokenizer as export_tokenizer  # noqa: E402
from train.hf import init_from as hf_init  # noqa: E402
from train.runs import tokenizer as run_tokenizer  # noqa: E402
from train.runs.errors import RunError  # noqa: E402
from train.sample import prompts as sample_prompts  # noqa: E402

OWN = chat_datasets.OWN_TEMPLATE
BOS, USER, ASSISTANT = 1, 155, 156  # hf_models.make_tokenizer's ids


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
  """Tokenizer directories: the template in chat_template.json only, in chat_template.jinja, in
  tokenizer_config.json, and none."""
  root = tmp_path_factory.mktemp("tokenizers")
  made = {"json": chat_datasets.hf_tokenizer(root / "json", template=OWN, template_json=True),
          "jinja": chat_datasets.hf_tokenizer(root / "jinja", template=OWN),
          "none": chat_datasets.hf_tokenizer(root / "none")}
  config = root / "config"
  shutil.copytree(made["none"], config)
  settings = json.loads((config / "tokenizer_config.json").read_text())
  (config / "tokenizer_config.json").write_text(json.dumps(dict(settings, chat_template=OWN)))
  made["config"] = config
  return made


@pytest.fixture(scope="module")
def chats(tmp_path_factory):
  """Chat datasets of one tokenizer: rendered with its own template, with segpack's (trained on
  the assistant's turns, or on everything), and a plain-text one."""
  root = tmp_path_factory.mktemp("chats")
  own = chat_datasets.hf_tokenizer(root / "own", template=OWN)
  conversations = chat_datasets.write_chats(root / "chats.jsonl")
  texts = chat_datasets.write_texts(root / "texts.jsonl")
  tokenize = chat_datasets.tokenize
  return {
      "own": tokenize(conversations, root / "own_data", "--tokenizer", f"hf:{own}"),
      "segpack": tokenize(conversations, root / "segpack_data", "--tokenizer", f"hf:{own}",
                          "--chat-template", "segpack"),
      "segpack all": tokenize(conversations, root / "segpack_all", "--tokenizer", f"hf:{own}",
                              "--chat-template", "segpack", "--train-on", "all"),
      "text": tokenize(texts, root / "text_data", "--tokenizer", f"hf:{own}"),
  }


def _config(train=None, init_from=None):
  config = packed.get_config("smoke")
  config.data.train = train
  config.model.init_from = init_from
  return config


def _imported(workdir, tokenizer_dir):
  """`workdir` as an imported model's run: its `hf_source` holds `tokenizer_dir`'s files."""
  shutil.copytree(tokenizer_dir, workdir / hf_init.SOURCE_DIR)
  return str(workdir)


def test_one_rule_finds_a_template_in_each_of_its_three_places(tokenizers, tmp_path):
  want = {"json": "chat_template.json", "jinja": "chat_template.jinja",
          "config": "tokenizer_config.json"}
  for kind, name in want.items():
    assert hf_chat.has_template(tokenizers[kind]), kind
    assert hf_chat.template_file(tokenizers[kind]).name == name
    assert hf_chat.HfChatTemplate(tokenizers[kind]).template == OWN, kind
  # Negative controls: no template file; a chat_template.json holding no template.
  assert not hf_chat.has_template(tokenizers["none"])
  empty = tmp_path / "empty"
  shutil.copytree(tokenizers["none"], empty)
  (empty / "chat_template.json").write_text('{"other": "x"}')
  assert not hf_chat.has_template(empty) and hf_chat.template_file(empty) is None


def test_a_run_imported_with_only_chat_template_json_has_that_template(tokenizers, tmp_path):
  """The trainer asks the same rule: an imported model whose template is in chat_template.json
  samples (and exports) with it; one with no template has none, and `--chat` says so."""
  workdir = _imported(tmp_path / "run", tokenizers["json"])
  config = _config(init_from="model")
  config.data.source = "builtin"
  renderer = run_tokenizer.chat_renderer(config, workdir)
  assert isinstance(renderer, hf_chat.HfChatTemplate) and renderer.template == OWN
  assert renderer.prompt_ids([{"role": "user", "content": "w1"}]) == [BOS, USER, 5, 157,
                                                                      ASSISTANT]
  assert run_tokenizer.chat_renderer(config, workdir, stage=False).template == OWN
  bare = _imported(tmp_path / "bare", tokenizers["none"])
  assert run_tokenizer.chat_renderer(config, bare) is None
  with pytest.raises(sample_prompts.SampleError, match="^--chat needs a run on chat data"):
    sample_prompts.chat_renderer(config, bare)


def test_tokenize_renders_with_a_template_found_in_chat_template_json(tokenizers, tmp_path):
  conversations = chat_datasets.write_chats(tmp_path / "chats.jsonl")
  out = chat_datasets.tokenize(conversations, tmp_path / "data", "--tokenizer",
                               f"hf:{tokenizers['json']}", "--chat-template", "own")
  described = json.loads((out / "manifest.json").read_text())["metadata"]["chat"]
  assert described["renderer"] == "hf" and described["template_file"] == "chat_template.json"
  renderer = hf_chat.for_dataset(out)
  assert renderer.template == OWN
  assert renderer.encode(chat_datasets.CONVERSATIONS[0])[0].tolist()[:2] == [BOS, USER]


def _mixture(chats, *names):
  return ",".join(f"{n.replace(' ', '_')}={chats[n]}:1" for n in names)


def test_a_mixture_rendered_differently_is_refused_alike_by_sample_and_export(chats, tmp_path):
  config = _config(train=_mixture(chats, "segpack", "text", "own"))
  with pytest.raises(RunError) as sampled:
    sample_prompts.chat_renderer(config, str(tmp_path))
  with pytest.raises(RunError) as exported:
    export_files.write_files(str(tmp_path / "out"), config, str(tmp_path), vocab_size=160)
  line = str(sampled.value)
  assert str(exported.value) == line and "\n" not in line
  assert line.startswith(f"data.train={config.data.train!r}: its chat sources were rendered "
                         f"with different chat templates ({chats['segpack']}: segpack's template; "
                         f"{chats['own']}: its tokenizer's own template chat_template.jinja ")
  assert not (tmp_path / "out").exists()


def test_a_mixture_rendered_alike_has_its_template(chats, tmp_path):
  """Positive controls: segpack's template trained on different turns renders alike; a plain
  source beside a chat one leaves the chat one's template; plain text alone has none."""
  config = _config(train=_mixture(chats, "segpack", "segpack all", "text"))
  renderer = run_tokenizer.chat_renderer(config, str(tmp_path))
  assert isinstance(renderer, chat.ChatEncoder) and renderer.template == chat.DEFAULT_TEMPLATE
  assert export_tokenizer.exported_template(renderer) == chat.DEFAULT_TEMPLATE
  own = run_tokenizer.chat_renderer(_config(train=_mixture(chats, "text", "own")), str(tmp_path))
  assert isinstance(own, hf_chat.HfChatTemplate) and own.template == OWN
  assert export_tokenizer.exported_template(own) is None  # its files are copied as they are
  assert run_tokenizer.chat_renderer(_config(train=str(chats["text"])), str(tmp_path)) is None
