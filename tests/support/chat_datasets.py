"""Small datasets of every kind `segpack tokenize` writes (plain text with a SentencePiece model or
a Hugging Face tokenizer, chat with segpack's template or a tokenizer's own), made here in
seconds, and a manifest's metadata edited with its digest kept valid; shared by the dataset
record tests and the run chat-template tests. Nothing is downloaded: the Hugging Face tokenizer
is `hf_models.make_tokenizer`'s."""

import json
import pathlib

from segpack.cli import tokenize as tokenize_cli
from segpack.shards import format as shard_format
from segpack.text.tokenizers import spm
from support import hf_models

# A template of a tokenizer's own, unlike segpack's: BOS first, the end-of-turn after every
# message (tests/text/chat/test_chat_template_flag.py renders it).
OWN_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ '<|' + m['role'] + '|>' }} "
                "{{ m['content'] }} {{ '<|end|>' }} {% endfor %}{% if add_generation_prompt %}"
                "{{ '<|assistant|>' }} {% endif %}")
CONVERSATIONS = [
    [{"role": "user", "content": "w1 w2"}, {"role": "assistant", "content": "w3"}],
    [{"role": "system", "content": "w10 w11"}, {"role": "user", "content": "w5"},
     {"role": "assistant", "content": "w6 w7 w8"}],
]


def spm_model(directory: pathlib.Path) -> pathlib.Path:
  """A 400-piece SentencePiece model trained on the `json` package's sources (under a second)."""
  sources = pathlib.Path(json.__file__).parent
  texts = [p.read_text("utf-8") for p in sorted(sources.glob("*.py"))]
  return spm.train_spm(texts, directory / "spm.model", vocab_size=400).model_file


def hf_tokenizer(directory: pathlib.Path, *, template: str | None = None,
                 template_json: bool = False) -> pathlib.Path:
  """`hf_models.make_tokenizer`'s word-level tokenizer in `directory`, with `template` (when
  given) as `chat_template.jinja`, or as `chat_template.json` with `template_json`."""
  hf_models.make_tokenizer(str(directory))
  if template is not None and template_json:
    (directory / "chat_template.json").write_text(json.dumps({"chat_template": template}))
  elif template is not None:
    (directory / "chat_template.jinja").write_text(template, encoding="utf-8")
  return directory


def write_chats(path: pathlib.Path, conversations=CONVERSATIONS) -> pathlib.Path:
  """`conversations` as `{"messages": ...}` JSON lines."""
  path.write_text("".join(json.dumps({"messages": m}) + "\n" for m in conversations), "utf-8")
  return path


def write_texts(path: pathlib.Path, n: int = 20) -> pathlib.Path:
  """`n` plain documents of words the word-level tokenizer knows, `{"text": ...}` per line."""
  return pathlib.Path(hf_models.write_text_jsonl(str(path), n, seed=3))


def tokenize(inputs: pathlib.Path, out: pathlib.Path, *flags: str) -> pathlib.Path:
  """`segpack tokenize --input INPUTS --output OUT FLAGS...` (exit status 0 asserted)."""
  rc = tokenize_cli.main(["--input", str(inputs), "--output", str(out), "--no-progress", *flags])
  assert rc == 0, rc
  return out


def edit_metadata(dataset: pathlib.Path, edit) -> None:
  """Replaces the manifest's metadata by `edit(metadata)` (which may change it in place and
  return None) and rewrites `metadata_sha256` to match, so that only the record's checks see
  the change."""
  path = dataset / shard_format.MANIFEST_NAME
  manifest = json.loads(path.read_text("utf-8"))
  edited = edit(manifest["metadata"])
  manifest["metadata"] = manifest["metadata"] if edited is None else edited
  manifest["metadata_sha256"] = shard_format.metadata_sha256(manifest["metadata"])
  path.write_text(json.dumps(manifest, indent=2), "utf-8")
