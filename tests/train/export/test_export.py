"""`python -m train.export`: a run exported as a Hugging Face directory loads in transformers with
no missing or unexpected keys and gives the checkpoint's logits (1e-5), for imported models
(Llama with llama3 RoPE scaling, tied Qwen2 on chat data, Qwen3) and a model trained from scratch
on the built-in corpus; config.json round-trips to the run's model keys; the tokenizer encodes as
segpack's did, the chat template renders the ids segpack stored; a killed export leaves no output
directory; the command's errors are one line (tiny models made here; nothing is downloaded)."""

import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import types

import grain
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

pytest.importorskip("transformers")
pytest.importorskip("torch")

from support import hf_models  # noqa: E402
from support import train_configs  # noqa: E402
from support.train_configs import run_cli  # noqa: E402
from configs import packed  # noqa: E402
from segpack import files  # noqa: E402
from segpack import shards  # noqa: E402
from segpack.text import chat  # noqa: E402
from segpack.text import corpus  # noqa: E402
from segpack.text.chat import corpus as chat_corpus  # noqa: E402
from segpack.text.tokenizers import hf as hf_tokenizer  # noqa: E402
from train import data as data_lib  # noqa: E402
from train.export import command as export_lib  # noqa: E402
from train.hf import config as hf_config  # noqa: E402
from train.export import files as hf_export  # noqa: E402
from train.export import tokenizer as hf_export_tokenizer  # noqa: E402
from train.hf import weights as hf_weights  # noqa: E402
from train import sharding as sharding_lib  # noqa: E402
from train.runs import tokenizer as run_tokenizer  # noqa: E402
from train.runs import saved as saved_run  # noqa: E402
from train.runs import loaded as loaded_run  # noqa: E402
from support import paths

REPO = paths.REPO
# Logits agree to 1e-5 of their scale: max |ours - theirs| <= 1e-5 * max(1, max |theirs|). The
# imported models' weights (std 0.2) give logits up to ~6, and there float32 itself is the limit:
# segpack's and transformers' float32 logits are each 1-2e-5 from transformers' float64 logits
# (measured), so an absolute 1e-5 between the two would test rounding, not the export.
ATOL = 1e-5
LLAMA3 = dict(rope_type="llama3", rope_theta=500_000.0, factor=8.0, low_freq_factor=1.0,
              high_freq_factor=4.0, original_max_position_embeddings=64)
# The imported runs: (family, source model settings, dataset).
# The chat run is the Qwen3 one: transformers 5.24's AutoTokenizer loads every model_type "qwen2"
# directory with Qwen2Tokenizer, whose byte-level pre-tokenizer replaces the word-level one of
# the test tokenizer (the source directory reads the same), whatever tokenizer_config.json says.
RUNS = {"llama": ("llama", dict(tie=False, rope=LLAMA3), "text"),
        "qwen2": ("qwen2", dict(tie=True), "text"),
        "qwen3": ("qwen3", dict(tie=False, eos_token_id=[2, 157]), "chat"),
        "bfloat16": ("llama", dict(tie=True, dtype="bfloat16"), "text")}
COMPARED = ("llama", "qwen2", "qwen3")  # float32 runs: their logits are compared


def _ids(encoded):
  """`apply_chat_template(tokenize=True)`'s ids (a BatchEncoding in transformers 5, a list in 4)."""
  return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
  return hf_models.make_tokenizer(str(tmp_path_factory.mktemp("tok") / "tok"))


@pytest.fixture(scope="module")
def datasets(tokenizer_dir, tmp_path_factory):
  """A plain-text and a chat dataset tokenized with `--tokenizer hf:DIR` (every model directory
  below holds copies of the same tokenizer files, so one fingerprint fits them all)."""
  root = tmp_path_factory.mktemp("data")
  hf_models.write_text_jsonl(str(root / "docs.jsonl"), 60, seed=4)
  hf_models.write_chat_jsonl(str(root / "chat.jsonl"), 60, seed=1)
  for name, source in (("text", "docs.jsonl"), ("chat", "chat.jsonl")):
    run_cli("segpack", "tokenize", "--input", str(root / source), "--tokenizer",
            f"hf:{tokenizer_dir}", "--output", str(root / name))
  return root


def _train(config, workdir, *, steps=3):
  train_configs.short_run(config, workdir, steps=steps)


@pytest.fixture(scope="module")
def runs(tokenizer_dir, datasets, tmp_path_factory):
  """`get(name)`: the imported run `RUNS[name]` trained 3 steps and exported (made once)."""
  made = {}

  def get(name):
    if name not in made:
      family, settings, data = RUNS[name]
      root = tmp_path_factory.mktemp(name)
      model_dir = hf_models.make_model(str(root / "source"), family, **settings)
      for file in os.listdir(tokenizer_dir):
        shutil.copyfile(os.path.join(tokenizer_dir, file), os.path.join(model_dir, file))
      config = packed.get_config()
      config.model.init_from = model_dir
      config.data.train = str(datasets / data)
      config.packing.seq_len = 256
      hf_config.adopt(config)
      _train(config, root / "run")
      result = export_lib.export(workdir=str(root / "run"), output=str(root / "exported"))
      made[name] = types.SimpleNamespace(source=model_dir, workdir=str(root / "run"),
                                         out=str(root / "exported"), result=result, data=data)
    return made[name]

  return get


def _segpack_logits(decoder, doc):
  """The checkpoint's logits `[n, V]` of one document alone (the training forward pass)."""
  ids = jnp.asarray(np.asarray(doc)[None], jnp.int32)
  return np.asarray(decoder(ids, segment_ids=jnp.ones_like(ids),
                            segment_positions=jnp.arange(ids.shape[1], dtype=jnp.int32)[None]))[0]


def _assert_close(ours, theirs, what):
  err, scale = float(np.abs(ours - theirs).max()), max(1.0, float(np.abs(theirs).max()))
  assert err <= ATOL * scale, (what, err, scale)


def _loaded(out):
  import torch
  import transformers
  model, info = transformers.AutoModelForCausalLM.from_pretrained(
      out, output_loading_info=True, dtype=torch.float32)
  assert not info["missing_keys"] and not info["unexpected_keys"], info
  assert not info.get("mismatched_keys") and not info.get("error_msgs"), info
  return model.eval()


def _hf_logits(model, doc):
  import torch
  with torch.no_grad():
    return model(input_ids=torch.as_tensor(np.asarray(doc)[None], dtype=torch.long)
                 ).logits[0].float().numpy()


def _checkpoint_params(decoder):
  flat = {}
  import jax
  jax.tree_util.tree_map_with_path(lambda p, x: flat.__setitem__(sharding_lib.param_name(p), x),
                                   nnx.split(decoder)[1])
  return flat


def _tensors(directory):
  from safetensors.numpy import load_file
  out = {}
  for name in os.listdir(directory):
    if name.endswith(".safetensors"):
      out.update(load_file(os.path.join(directory, name)))
  return out


@pytest.mark.parametrize("name", COMPARED)
def test_transformers_loads_the_export_with_the_checkpoints_logits(runs, name):
  run = runs(name)
  model = _loaded(run.out)
  config, decoder, step = loaded_run.load_run(run.workdir)
  assert step == 3 and run.result.step == 3
  docs = hf_models.documents(3, lengths=[200, 90, 40], seed=5)  # 330 tokens, past 64 positions
  source = _loaded(run.source)
  for doc in docs:
    theirs = _hf_logits(model, doc)
    _assert_close(_segpack_logits(decoder, doc), theirs, name)
    # Negative control: the source model's logits are far off, so the trained weights are written.
    assert np.abs(_hf_logits(source, doc) - theirs).max() > 1000 * ATOL
  # Every tensor is the checkpoint's parameter bit for bit (transposed back), none the source's.
  written, initial = _tensors(run.out), _tensors(run.source)
  params = _checkpoint_params(decoder)
  tensor_map = hf_weights.model_tensor_map(config.model)
  assert set(written) == {t.name for t in tensor_map.values()}
  for path, tensor in tensor_map.items():
    want = np.asarray(params[path])
    np.testing.assert_array_equal(written[tensor.name], want.T if tensor.transpose else want)
    assert written[tensor.name].dtype == np.float32
  changed = [n for n in written if not np.array_equal(written[n], initial[n])]
  assert len(changed) == len(written), sorted(set(written) - set(changed))
  assert ("lm_head.weight" in written) == (not config.model.tie_embeddings)


def test_config_json_keeps_the_rope_scaling_special_ids_and_tying(runs):
  import transformers
  run = runs("llama")
  cfg, src = hf_models.read_json(f"{run.out}/config.json"), hf_models.read_json(
      f"{run.source}/config.json")
  scaling = {k: v for k, v in LLAMA3.items() if k != "rope_theta"}
  assert cfg["rope_theta"] == 500_000.0
  assert cfg["rope_scaling"] == dict(scaling, type="llama3")
  assert cfg["rope_parameters"] == LLAMA3
  assert cfg["tie_word_embeddings"] is False and cfg["torch_dtype"] == cfg["dtype"] == "float32"
  for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
    assert cfg[key] == src[key]
  assert (hf_models.read_json(f"{run.out}/generation_config.json")
          == hf_models.read_json(f"{run.source}/generation_config.json"))
  # Round trip: config.json read back gives the run's model keys.
  config, _ = saved_run.run_config(run.workdir)
  arch = hf_config.architecture(cfg, where="exported config.json")
  assert {k: arch[k] for k in hf_config.ARCH_KEYS} == {
      k: config.model[k] for k in hf_config.ARCH_KEYS}
  assert arch["rope_scaling"] == {k: config.model.rope_scaling[k] for k in hf_config.SCALING_KEYS}
  loaded = transformers.AutoConfig.from_pretrained(run.out)
  assert loaded.rope_parameters["rope_type"] == "llama3"
  assert loaded.rope_parameters["factor"] == 8.0 and loaded.rope_parameters["rope_theta"] == 5e5


def test_a_tied_model_stays_tied_and_a_listed_eos_is_kept(runs):
  import transformers
  qwen2, qwen3 = runs("qwen2"), runs("qwen3")
  cfg = hf_models.read_json(f"{qwen2.out}/config.json")
  assert cfg["tie_word_embeddings"] is True and cfg["model_type"] == "qwen2"
  assert cfg["use_sliding_window"] is False
  for name in os.listdir(qwen2.source):  # the tokenizer files are the source's, as they were
    if name.startswith("tokenizer") or name == "special_tokens_map.json":
      assert files.sha256_file(f"{qwen2.out}/{name}") == files.sha256_file(
          f"{qwen2.source}/{name}"), name
  cfg3 = hf_models.read_json(f"{qwen3.out}/config.json")
  assert cfg3["eos_token_id"] == [2, 157] and cfg3["head_dim"] == hf_models.HEAD_DIM
  # A chat run whose source already lists the template's end of turn (157) keeps its file as it
  # was; so does a plain-text run. (A source without it gains it: test_hf_train's own-template
  # walk and test_generation_config_gains_the_stop_ids_it_lacks.)
  end = transformers.AutoTokenizer.from_pretrained(qwen3.out).convert_tokens_to_ids(
      chat.DEFAULT_TEMPLATE.end_of_turn)
  assert end == 157
  assert transformers.GenerationConfig.from_pretrained(qwen3.out).eos_token_id == [2, 157]
  for run in (qwen2, qwen3):
    assert files.sha256_file(f"{run.out}/generation_config.json") == files.sha256_file(
        f"{run.source}/generation_config.json")


def test_generation_config_gains_the_stop_ids_it_lacks(tmp_path):
  source, out = tmp_path / "source", tmp_path / "out"
  source.mkdir()
  out.mkdir()
  ids = dict(bos_token_id=1, eos_token_id=2, pad_token_id=0)
  hf_export.write_generation_config(out, source=None, ids=ids, stop_ids=())
  assert hf_models.read_json(f"{out}/generation_config.json") == ids  # a plain-text run
  hf_export.write_generation_config(out, source=None, ids=ids, stop_ids=(7, 2, 7))
  assert hf_models.read_json(f"{out}/generation_config.json") == dict(ids, eos_token_id=[2, 7])
  (source / "generation_config.json").write_text('{"eos_token_id": 5, "do_sample": true}')
  hf_export.write_generation_config(out, source=source, ids=ids, stop_ids=(9,))
  assert hf_models.read_json(f"{out}/generation_config.json") == dict(eos_token_id=[5, 9],
                                                                     do_sample=True)
  (source / "generation_config.json").write_text('{"eos_token_id": [5, 9]}\n')
  hf_export.write_generation_config(out, source=source, ids=ids, stop_ids=(9,))
  assert (out / "generation_config.json").read_text() == '{"eos_token_id": [5, 9]}\n'


def test_bfloat16_parameters_are_written_as_bfloat16(runs):
  import torch
  from safetensors import safe_open
  run = runs("bfloat16")
  config, decoder, _ = loaded_run.load_run(run.workdir)
  assert config.model.param_dtype == "bfloat16"  # adopted from the source's dtype
  cfg = hf_models.read_json(f"{run.out}/config.json")
  assert cfg["torch_dtype"] == cfg["dtype"] == "bfloat16" and cfg["tie_word_embeddings"] is True
  params = _checkpoint_params(decoder)
  with safe_open(f"{run.out}/model.safetensors", framework="numpy") as f:
    assert f.metadata() == {"format": "pt"}
    for path, tensor in hf_weights.model_tensor_map(config.model).items():
      assert f.get_slice(tensor.name).get_dtype() == "BF16"
      want = np.asarray(params[path])
      np.testing.assert_array_equal(f.get_tensor(tensor.name), want.T if tensor.transpose else want)
  model = _loaded(run.out)
  assert next(model.parameters()).dtype == torch.float32  # loaded as asked, from bfloat16 files


def test_chat_template_renders_the_ids_segpack_trained_on(runs, datasets):
  import transformers
  run = runs("qwen3")
  assert run.result.chat_template and "chat_template.jinja" in os.listdir(run.out)
  tok = transformers.AutoTokenizer.from_pretrained(run.out)
  assert tok.chat_template == open(f"{run.out}/chat_template.jinja").read()
  assert json.load(open(f"{run.out}/tokenizer_config.json"))["chat_template"] == tok.chat_template
  conversations = [json.loads(line)["messages"] for line in open(datasets / "chat.jsonl")]
  stored = shards.ShardSource(str(datasets / "chat"))
  assert len(stored) == len(conversations)
  rendered = []
  for k, messages in enumerate(conversations):
    ids = _ids(tok.apply_chat_template(messages, tokenize=True))
    assert ids == [tok.bos_token_id] + stored[k].tolist(), k  # the pipeline's BOS first
    rendered.append(ids)
    if messages[-1]["role"] == "assistant":  # the prompt of the last answer
      prompt = _ids(tok.apply_chat_template(messages[:-1], tokenize=True,
                                            add_generation_prompt=True))
      assert ids[:len(prompt)] == prompt and prompt[-1] == tok.convert_tokens_to_ids(
          "<|assistant|>")
  # The documents of the run's first batch are rendered conversations followed by EOS.
  config, _ = saved_run.run_config(run.workdir)
  data = data_lib.make_data(config, batch_size=8,
                            process_index=0, process_count=1)
  batch = next(data.train_iterator(read_options=grain.ReadOptions(num_threads=1)))
  known = {tuple(ids + [tok.eos_token_id]) for ids in rendered}
  whole = 0
  for r in range(len(batch["input_ids"])):
    for s in np.unique(batch["segment_ids"][r][batch["segment_ids"][r] > 0]):
      ids = batch["input_ids"][r][batch["segment_ids"][r] == s].tolist()
      if ids[0] == tok.bos_token_id and ids[-1] == tok.eos_token_id:  # not a split chunk
        assert tuple(ids) in known
        whole += 1
  assert whole >= 3


def test_builtin_chat_template_equals_the_chat_encoder(tmp_path):
  import transformers
  config = packed.get_config("smoke")
  config.data.source = "builtin_chat"
  template = hf_export_tokenizer.exported_template(
      run_tokenizer.chat_renderer(config, str(tmp_path), stage=False))
  names, ids = hf_export_tokenizer.write_tokenizer(tmp_path, config, source=None,
                                                   template=template)
  assert "chat_template.jinja" in names and ids == dict(bos_token_id=2, eos_token_id=3,
                                                        pad_token_id=0)
  tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
  encoder = chat.ChatEncoder(run_tokenizer.tokenizer_for_run(config))
  assert encoder.markers_are_symbols
  conversations = chat_corpus.builtin_conversations(split="eval", size="small")
  for _, conversation in zip(range(8), conversations):
    want, _ = encoder.encode(conversation["messages"])
    got = _ids(tok.apply_chat_template(conversation["messages"], tokenize=True))
    assert got == [2] + want.tolist()


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
  """A `configs/packed.py:smoke` run on the built-in corpus (2 steps), exported."""
  root = tmp_path_factory.mktemp("scratch")
  config = packed.get_config("smoke")
  _train(config, root / "run", steps=2)
  result = export_lib.export(workdir=str(root / "run"), output=str(root / "exported"))
  return types.SimpleNamespace(workdir=str(root / "run"), out=str(root / "exported"),
                               result=result)


def test_a_model_trained_from_scratch_exports_as_a_llama(scratch):
  import transformers
  cfg = hf_models.read_json(f"{scratch.out}/config.json")
  assert cfg["model_type"] == "llama" and cfg["architectures"] == ["LlamaForCausalLM"]
  assert (cfg["bos_token_id"], cfg["eos_token_id"], cfg["pad_token_id"]) == (2, 3, 0)
  assert cfg["rope_scaling"] is None and cfg["rope_parameters"] == dict(rope_type="default",
                                                                        rope_theta=10_000.0)
  assert cfg["max_position_embeddings"] == 128 and cfg["vocab_size"] == 2048
  config, decoder, _ = loaded_run.load_run(scratch.workdir)
  arch = hf_config.architecture(cfg, where="exported config.json")
  for key in hf_config.ARCH_KEYS:
    want = {"vocab_size": 2048, "max_position_embeddings": 128}.get(key, config.model[key])
    assert arch[key] == want, key
  model = _loaded(scratch.out)
  built = corpus.ensure_builtin(size="small")
  tok = run_tokenizer.tokenizer_for_run(config)
  texts = [text for _, text in corpus.builtin_documents(split="eval", size="small")][:4]
  for text in texts[:3]:
    doc = [tok.bos_id] + tok.encode(text[:3000]).tolist()[:127]  # >= 300 tokens over the three
    assert len(doc) == 128
    _assert_close(_segpack_logits(decoder, doc), _hf_logits(model, doc), "scratch")
  # The tokenizer: transformers' and segpack's own reading of tokenizer.json give SentencePiece's
  # ids (transformers adds the BOS the pipeline adds, and no EOS).
  hf_tok = transformers.AutoTokenizer.from_pretrained(scratch.out)
  ours = hf_tokenizer.HfTokenizer(scratch.out)
  assert ours.bos_id == 2 and ours.eos_id == 3 and ours.vocab_size == 2048
  for text in texts + list(hf_export_tokenizer.PROBE_TEXTS):
    want = tok.encode(text).tolist()
    assert hf_tok(text)["input_ids"] == [2] + want
    assert ours.encode(text).tolist() == want
    assert hf_tok.decode(want) == tok.decode(want)
  assert files.sha256_file(f"{scratch.out}/tokenizer.model") == files.sha256_file(built.spm_model)


@pytest.mark.parametrize("family,window,scaling,tie", [
    ("llama", None, None, False), ("llama", None, "linear", True), ("mistral", 256, None, False),
    ("mistral", None, "llama3", True), ("qwen2", None, None, True), ("qwen2", 512, None, False),
    ("qwen3", None, "llama3", False), ("qwen3", 1024, None, True)])
def test_to_hf_config_round_trips(family, window, scaling, tie, tmp_path):
  import transformers
  config = packed.get_config()
  m = config.model
  m.family, m.sliding_window, m.tie_embeddings = family, window, tie
  m.qkv_bias, m.qk_norm, m.head_dim = family == "qwen2", family == "qwen3", 32
  m.rope_scaling.type = scaling
  if scaling is not None:
    m.rope_scaling.factor = 4.0
  if scaling == "llama3":
    m.rope_scaling.original_max_position_embeddings = 128
  hf = hf_config.to_hf_config(m, vocab_size=300, base=None, dtype="bfloat16", seq_len=256,
                              special_ids=dict(bos_token_id=2, eos_token_id=3))
  arch = hf_config.architecture(hf, where="test")
  for key in hf_config.ARCH_KEYS:
    want = {"vocab_size": 300, "max_position_embeddings": 256}.get(key, m[key])
    assert arch[key] == want, key
  assert arch["rope_scaling"] == {k: m.rope_scaling[k] for k in hf_config.SCALING_KEYS}
  assert hf_config.torch_dtype(hf, "test") == "bfloat16" and hf["eos_token_id"] == 3
  hf_models.write_json(str(tmp_path / "config.json"), hf)
  loaded = transformers.AutoConfig.from_pretrained(str(tmp_path))
  assert loaded.rope_parameters["rope_type"] == (scaling or "default")
  if family != "llama":
    assert loaded.sliding_window == window
  # An imported model's config.json as the base keeps its other fields.
  base = dict(hf, initializer_range=0.5, custom_field="kept")
  again = hf_config.to_hf_config(m, vocab_size=300, base=base, dtype="bfloat16", seq_len=256,
                                 special_ids={})
  assert again["custom_field"] == "kept" and again["initializer_range"] == 0.5
  assert hf_config.architecture(again, where="test") == arch


def test_a_sentencepiece_model_of_other_settings_is_refused(tmp_path):
  import io
  import sentencepiece
  model = io.BytesIO()
  lines = [f"Sentence number {i} with some words, and more words {i * 7}." for i in range(300)]
  sentencepiece.SentencePieceTrainer.train(  # SentencePiece's defaults: NFKC, a dummy prefix
      sentence_iterator=iter(lines), model_writer=model, vocab_size=120, minloglevel=2)
  (tmp_path / "m.model").write_bytes(model.getvalue())
  with pytest.raises(hf_export.ExportError, match=r"m.model: the SentencePiece model encodes"):
    hf_export_tokenizer.spm_tokenizer(str(tmp_path / "m.model"), add_bos=True)


def test_to_hf_config_refuses_what_no_family_computes():
  config = packed.get_config()
  config.model.qkv_bias = True
  with pytest.raises(hf_config.HfModelError, match=r"model.qkv_bias=True with model.family="):
    hf_config.to_hf_config(config.model, vocab_size=10, base=None, special_ids={},
                           dtype="float32")


def test_shards_hold_at_most_max_shard_size_fetched_one_shard_at_a_time(runs, tmp_path,
                                                                        monkeypatch):
  run = runs("llama")
  fetched, saved = [], []
  fetch, save = hf_export.fetch, hf_export.save_shard

  def counting_fetch(array):
    out = fetch(array)
    fetched.append(out.nbytes)
    return out

  def checking_save(tensors, path):
    held = sum(t.nbytes for t in tensors.values())
    assert held == sum(fetched) - sum(saved)  # nothing else fetched and held
    assert held <= 40_000 or len(tensors) == 1
    saved.append(held)
    save(tensors, path)

  monkeypatch.setattr(hf_export, "fetch", counting_fetch)
  monkeypatch.setattr(hf_export, "save_shard", checking_save)
  result = export_lib.export(workdir=run.workdir, output=str(tmp_path / "out"),
                             max_shard_bytes=40_000)
  assert len(result.weight_files) == len(saved) > 3
  index = hf_models.read_json(str(tmp_path / "out" / hf_weights.INDEX_NAME))
  assert set(index["weight_map"].values()) == set(result.weight_files)
  assert index["metadata"]["total_size"] == result.total_bytes == sum(saved)
  assert not os.path.exists(tmp_path / "out" / hf_weights.SINGLE_NAME)
  model = _loaded(str(tmp_path / "out"))
  doc = hf_models.documents(1, lengths=[120], seed=7)[0]
  np.testing.assert_allclose(_hf_logits(model, doc), _hf_logits(_loaded(run.out), doc), atol=0)


def _stderr_line(capsys):
  lines = capsys.readouterr().err.strip().splitlines()
  assert len(lines) == 1, lines
  assert lines[0].startswith("python -m train.export: error: "), lines
  return lines[0]


def test_an_export_that_fails_midway_leaves_no_output(runs, tmp_path, monkeypatch):
  run = runs("llama")
  out = tmp_path / "out"
  calls = []
  save = hf_export.save_shard

  def fail_after_first(tensors, path):
    if calls:
      raise OSError(28, "No space left on device")
    calls.append(path)
    save(tensors, path)

  monkeypatch.setattr(hf_export, "save_shard", fail_after_first)
  with pytest.raises(OSError, match="No space left"):
    export_lib.export(workdir=run.workdir, output=str(out), max_shard_bytes=40_000)
  assert len(calls) == 1
  assert not out.exists() and not list(tmp_path.glob("out.tmp-*"))


def _safetensor_error(message):
  """safetensors' own exception (not an OSError) with `message`, as its Rust writer raises it."""
  safetensors = pytest.importorskip("safetensors")
  return safetensors.SafetensorError(message)


@pytest.mark.parametrize("number", [28, 122, 30], ids=["ENOSPC", "EDQUOT", "EROFS"])
def test_a_full_disk_is_one_line_naming_the_output_and_publishes_nothing(runs, tmp_path,
                                                                          monkeypatch, capfd,
                                                                          number):
  import safetensors.numpy
  run = runs("llama")
  capfd.readouterr()  # what making the run printed
  out = tmp_path / "out"
  save, calls = safetensors.numpy.save_file, []

  def fill_disk(tensors, path, metadata=None):
    if calls:  # the second shard finds the disk full, as safetensors 0.8 reports it there
      raise _safetensor_error(f"Error while serializing: I/O error: {os.strerror(number)} "
                              f"(os error {number})")
    calls.append(path)
    save(tensors, path, metadata=metadata)

  monkeypatch.setattr(safetensors.numpy, "save_file", fill_disk)
  status = export_lib.main(["--workdir", run.workdir, "--output", str(out),
                            "--max-shard-size", "40KB"])
  err = capfd.readouterr().err.strip().splitlines()
  assert status == 2 and len(calls) == 1, (status, err)
  assert len(err) == 1 and "Traceback" not in err[0] and "internal error" not in err[0], err
  assert err[0].startswith(f"python -m train.export: error: --output {str(out)!r}: writing "
                           f"model-00002-of-"), err
  assert os.strerror(number) in err[0] and "nothing was published" in err[0]
  assert re.search(r"\(\d+\.\d MB free there\)", err[0]), err
  assert sorted(os.listdir(tmp_path)) == []  # no output, no staging directory, no lock file


def test_a_safetensors_error_of_no_disk_is_still_a_bug(runs, tmp_path, monkeypatch, capfd):
  import safetensors.numpy
  run = runs("llama")
  capfd.readouterr()
  out = tmp_path / "out"

  def broken(tensors, path, metadata=None):
    raise _safetensor_error("Error while serializing: tensor a is not contiguous")

  monkeypatch.setattr(safetensors.numpy, "save_file", broken)
  assert export_lib.main(["--workdir", run.workdir, "--output", str(out)]) == 1
  err = capfd.readouterr().err
  assert "Traceback" in err and "SafetensorError" in err
  assert err.strip().splitlines()[-1].startswith("python -m train.export: internal error")
  assert sorted(os.listdir(tmp_path)) == []


def test_a_killed_export_leaves_no_output_and_a_rerun_cleans_up(runs, tmp_path):
  run = runs("llama")
  out = tmp_path / "out"
  child = (
      "import os, signal, sys\n"
      "from train.export import command as export, files as hf_export\n"
      "save = hf_export.save_shard\n"
      "def killing(tensors, path):\n"
      "  save(tensors, path)\n"
      "  os.kill(os.getpid(), signal.SIGKILL)\n"
      "hf_export.save_shard = killing\n"
      f"export.main(['--workdir', {run.workdir!r}, '--output', {str(out)!r},"
      " '--max-shard-size', '40KB'])\n")
  proc = subprocess.run([sys.executable, "-c", child], cwd=REPO, capture_output=True, text=True,
                        env=dict(os.environ, PYTHONPATH=str(REPO)), timeout=600)
  assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
  assert not out.exists()
  leftovers = list(tmp_path.glob("out.tmp-*"))
  assert len(leftovers) == 1 and len(os.listdir(leftovers[0])) == 1  # one shard, no index
  result = export_lib.export(workdir=run.workdir, output=str(out), max_shard_bytes=40_000)
  assert not list(tmp_path.glob("out.tmp-*")) and len(result.weight_files) > 3
  _loaded(str(out))


def test_an_existing_output_is_refused_and_overwrite_replaces_it(runs, tmp_path, capsys):
  run = runs("llama")
  out = tmp_path / "out"
  args = ["--workdir", run.workdir, "--output", str(out)]
  assert export_lib.main(args) == 0
  (out / "config.json").write_text("{}")  # an earlier export, edited
  capsys.readouterr()
  assert export_lib.main(args) == 2
  line = _stderr_line(capsys)
  assert f"--output {str(out)!r} exists and is not empty; pass --overwrite" in line
  assert (out / "config.json").read_text() == "{}"
  assert export_lib.main(args + ["--overwrite"]) == 0
  assert capsys.readouterr().out.startswith(f"wrote {out}: step 3, 21 tensors")
  assert (out / "config.json").read_text() != "{}" and "model.safetensors" in os.listdir(out)
  assert not list(tmp_path.glob("out.old-*")) and not list(tmp_path.glob("out.tmp-*"))
  empty = tmp_path / "empty"
  empty.mkdir()  # an empty directory is simply filled
  assert export_lib.main(["--workdir", run.workdir, "--output", str(empty)]) == 0


def test_a_locked_output_is_refused(runs, tmp_path, capsys):
  run = runs("llama")
  out = tmp_path / "out"
  with files.file_lock(tmp_path / ".out.export-lock", wait=False):
    assert export_lib.main(["--workdir", run.workdir, "--output", str(out)]) == 2
  line = _stderr_line(capsys)
  assert f"--output {str(out)!r} is being written by another export (pid {os.getpid()}" in line
  assert not out.exists()


def test_errors_are_one_line_naming_the_flag(runs, tmp_path, capsys, monkeypatch):
  assert export_lib.main(["--workdir", str(tmp_path), "--output", str(tmp_path / "o")]) == 2
  assert f"--workdir {str(tmp_path)!r} holds no checkpoint" in _stderr_line(capsys)
  run = runs("llama")
  missing = tmp_path / "no" / "such" / "dir"
  assert export_lib.main(["--workdir", run.workdir, "--output", str(missing)]) == 2
  line = _stderr_line(capsys)
  assert f"--output {str(missing)!r}: its parent" in line and "not an existing directory" in line
  (tmp_path / "file").write_text("x")
  assert export_lib.main(["--workdir", run.workdir, "--output", str(tmp_path / "file")]) == 2
  assert "exists and is not a directory" in _stderr_line(capsys)
  real_access = os.access
  monkeypatch.setattr(export_lib.os, "access",
                      lambda p, mode: False if str(p) == str(tmp_path) else real_access(p, mode))
  assert export_lib.main(["--workdir", run.workdir, "--output", str(tmp_path / "o")]) == 2
  assert f"its parent {str(tmp_path)!r} is not writable" in _stderr_line(capsys)
  with pytest.raises(SystemExit) as exit_info:
    export_lib.main(["--workdir", run.workdir, "--output", "o", "--max-shard-size", "lots"])
  assert exit_info.value.code == 2
  assert "--max-shard-size" in capsys.readouterr().err
  assert hf_export.parse_size("5GB") == 5 * 10**9 and hf_export.parse_size("2GiB") == 2 << 30
  assert hf_export.parse_size("100KB") == 100_000 and hf_export.parse_size("1234") == 1234


def test_the_command_runs_as_a_module(runs, tmp_path):
  run = runs("qwen3")
  proc = run_cli("train.export", "--workdir", run.workdir, "--output", str(tmp_path / "out"),
                 "--max-shard-size", "60KB")
  assert proc.stdout.startswith(f"wrote {tmp_path / 'out'}: step 3,")
  assert os.path.isfile(tmp_path / "out" / hf_weights.INDEX_NAME)
  _loaded(str(tmp_path / "out"))


@pytest.mark.parametrize("umask", [0o022, 0o027], ids=["022", "027"])
def test_exported_files_follow_the_umask_and_the_lock_is_removed(runs, tmp_path, umask):
  run = runs("llama")
  out = tmp_path / "out"
  old = os.umask(umask)
  try:
    export_lib.export(workdir=run.workdir, output=str(out), max_shard_bytes=40_000)
  finally:
    os.umask(old)
  names = sorted(os.listdir(out))
  assert hf_weights.INDEX_NAME in names and "config.json" in names and "tokenizer.json" in names
  modes = {name: oct(os.stat(out / name).st_mode & 0o777) for name in names}
  assert modes == {name: oct(0o666 & ~umask) for name in names}
  assert oct(os.stat(out).st_mode & 0o777) == oct(0o777 & ~umask)
  assert sorted(os.listdir(tmp_path)) == ["out"]  # no .out.export-lock, no staging left


def test_a_lock_file_with_remove_is_removed_while_held(tmp_path):
  lock = tmp_path / ".out.export-lock"
  with files.file_lock(lock, wait=False, remove=True):
    with pytest.raises(files.LockHeldError):
      with files.file_lock(lock, wait=False, remove=True):
        pass
    assert lock.exists()
  assert not lock.exists()
  with files.file_lock(lock, wait=False, remove=True):  # taken again at once
    assert lock.exists()
  assert not lock.exists()


def _snapshot(root):
  return sorted((path, sorted(dirs), sorted(names)) for path, dirs, names in os.walk(root))


def test_an_output_that_is_holds_or_is_inside_a_run_or_not_an_export_is_refused(
    runs, tmp_path, capsys, monkeypatch):
  run = runs("llama")
  capsys.readouterr()  # what making the run printed
  workdir = pathlib.Path(run.workdir)
  other = tmp_path / "other_run"
  shutil.copytree(workdir, other, ignore=shutil.ignore_patterns("checkpoints"))
  mine = tmp_path / "mine"
  mine.mkdir()
  (mine / "notes.txt").write_text("keep me")
  (mine / "config.json").write_text("{}")
  monkeypatch.chdir(workdir.parent)
  cases = {str(workdir): "is the run --workdir", str(workdir / "checkpoints"): "is inside the run",
           str(workdir / "exported"): "is inside the run", ".": "holds the run --workdir",
           str(other / "checkpoints"): "is inside the run", str(other): "is the run",
           str(mine): r"holds \['notes.txt'\], which an export does not write"}
  before = _snapshot(tmp_path), _snapshot(workdir)
  for output, message in cases.items():
    for overwrite in ([], ["--overwrite"]):
      rc = export_lib.main(["--workdir", run.workdir, "--output", output, *overwrite])
      line = _stderr_line(capsys)
      assert rc == 2 and re.search(f"--output {re.escape(repr(output))} {message}", line), (
          output, overwrite, line)
  assert (_snapshot(tmp_path), _snapshot(workdir)) == before  # nothing deleted or left behind
