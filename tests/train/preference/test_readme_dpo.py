"""The README's "Train on preferences" block, run as a new user would on a tiny model made here
(an SFT export first, as the block before it makes), with fewer steps; the exported model loads
in transformers. Then docs/preference.md's "## The reference: computed once" block on the same
pairs, with another model's scores as the reference: its first loss is not ln 2, as a reference
equal to the policy gives (the README run's, the negative control)."""

import json

import pytest

pytest.importorskip("transformers")

from support import hf_models  # noqa: E402
from support import doc_blocks  # noqa: E402
from support import preference_fixtures  # noqa: E402


def test_readme_preference_commands(tmp_path):
  import transformers
  commands = doc_blocks.commands("## Train on preferences")
  assert commands[0].startswith("python -m segpack tokenize --format preference")
  assert commands[1].startswith("python -m train.main --config=configs/dpo.py")
  assert commands[2].startswith("python -m train.export")
  exported = hf_models.make_tokenizer(hf_models.make_model(str(tmp_path / "exported"), "llama"))
  preference_fixtures.write_jsonl(tmp_path / "pairs.jsonl", preference_fixtures.word_pairs(
      40, prompt=(2, 30), answer=(1, 40), seed=7))
  subs = {"pairs.jsonl": str(tmp_path / "pairs.jsonl"), "data/pairs": str(tmp_path / "pairs"),
          "runs/dpo": str(tmp_path / "run"), "dpo_model": str(tmp_path / "dpo_model"),
          "exported": exported}
  fewer = [
      "--config.train.num_steps=3", "--config.train.eval_every=3",
      "--config.train.checkpoint_every=3", "--config.attention.self_check=False",
      "--config.packing.seq_len=256"]
  for args, out in doc_blocks.run(commands, subs, train_args=fewer):
    if args[0] == "train.main":
      assert "reference: the initial weights scored 40 pairs once" in out.stdout
  records = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
  assert records[0]["kind"] == "eval" and abs(records[0]["eval_loss"] - 0.6931471805599453) < 1e-6
  assert records[-1]["kind"] == "summary" and records[-1]["steps"] == 3
  model, info = transformers.AutoModelForCausalLM.from_pretrained(
      str(tmp_path / "dpo_model"), output_loading_info=True)
  assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
  ref = hf_models.make_tokenizer(hf_models.make_model(str(tmp_path / "ref"), "llama", seed=1))
  commands = doc_blocks.commands("## The reference: computed once", doc="docs/preference.md")
  assert [c.split()[2] for c in commands] == ["train.preference.score", "train.main"]
  subs = {"REF_MODEL_DIR": ref, "MODEL_DIR": exported, "data/pairs": str(tmp_path / "pairs"),
          "ref_scores": str(tmp_path / "ref_scores"), "runs/dpo_ref": str(tmp_path / "run_ref")}
  list(doc_blocks.run(commands, subs, train_args=fewer))
  records = [json.loads(line) for line in open(tmp_path / "run_ref" / "metrics.jsonl")]
  assert records[0]["kind"] == "eval" and abs(records[0]["eval_loss"] - 0.6931471805599453) > 1e-3
  assert records[-1]["kind"] == "summary" and records[-1]["steps"] == 3
