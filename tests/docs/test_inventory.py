"""Every bash and Python block of README.md and docs/*.md is run as written by a named test
(names of files replaced, fewer steps), holds only commands of a block that is, or says here why
no test can run it. A new block fails `test_every_block_is_accounted_for` until it is listed.

`RUN`: the test (`path::function`; a fixture's function counts) whose source names the block's
heading, so that it reads the block from the document. `SAME`: the key of a `RUN` block holding
each of its commands, after the names in `subs` are replaced. `NOT`: why no test can run it.
"""

import ast

import pytest

from support import doc_blocks
from support import paths

RUN, SAME, NOT = "run", "same", "not run"
README = "README.md"
_TRAINING_BLOCKS = "tests/docs/test_readme_blocks.py::test_the_main_job_then_the_training_blocks"
_USE = "tests/docs/test_readme_blocks.py::test_the_use_blocks"
_PY = "tests/docs/test_python_blocks.py::"
_SFT = "tests/docs/test_fine_tune_blocks.py::test_fine_tune_then_ask"
_OWN = "### Fine-tuning with the model's own chat template (`segpack.text.chat.hf_chat`)"
_BENCH = ("the command that measured the figures below it, at full size (minutes, or a GPU); "
          "the benchmark runs at a tiny size in tests/bench/ and tests/train/bench/")
_HEADING_BENCH = "## Chat stored one sample per assistant turn: `segpack bench chat-turns` (2026-11-26)"

INVENTORY = {
    (README, "# segpack", 0): (RUN, _TRAINING_BLOCKS),
    (README, "# segpack", 1): (RUN, "tests/docs/test_inventory.py::test_ci_runs_the_readme_test_command"),
    (README, "# segpack", 2): (RUN, "tests/train/test_own_data.py::test_readme_train_on_your_own_text"),
    (README, "## Fine-tune a Hugging Face model", 0): (RUN, _SFT),
    (README, "## Fine-tune with LoRA", 0): (
        RUN, "tests/train/adapters/test_readme_lora.py::test_readme_lora_commands"),
    (README, "## Train on preferences", 0): (
        RUN, "tests/train/preference/test_readme_dpo.py::test_readme_preference_commands"),
    (README, "## Reinforcement learning with verifiable rewards", 0): (
        RUN, "tests/train/rl/test_readme_grpo.py::test_readme_grpo_commands"),
    (README, "## Use", 0): (RUN, _USE),
    (README, "## Use", 1): (NOT, "Cloud Dataflow and gs:// buckets; the same command runs on "
                                 "DirectRunner against an S3 API (docs/ingest.md's blocks)"),
    (README, "## Use", 2): (RUN, _USE),
    (README, "## Use", 3): (RUN, _USE),
    (README, "## Use", 4): (RUN, "tests/docs/test_readme_blocks.py::test_the_attention_line_of_use"),
    (README, "## Use", 5): (RUN, _TRAINING_BLOCKS),
    (README, "## Use", 6): (NOT, _BENCH),
    (README, "## Use", 7): (NOT, "needs an NVIDIA GPU; tests/bench/test_gpu_report.py makes the "
                                 "same report on the CPU (--platform cpu)"),
    ("docs/adapters.md", "## Turn it on", 0): (SAME, (README, "## Fine-tune with LoRA", 0), {}),
    ("docs/adapters.md", "## Out", 0): (SAME, (README, "## Fine-tune with LoRA", 0), {}),
    ("docs/attention.md", "# Segment attention", 0): (RUN, _PY + "test_the_call_with_every_argument"),
    ("docs/attention.md", "## Per-backend settings, and the rules about backends", 0): (
        RUN, _PY + "test_the_backend_settings_block_in_interpret_mode"),
    ("docs/attention.md", "## Per-backend settings, and the rules about backends", 1): (
        NOT, "cuDNN needs an NVIDIA GPU (tests/attention/test_gpu.py, run with JAX_PLATFORMS=cuda)"),
    ("docs/attention.md", "## GPU test suite", 0): (NOT, "needs an NVIDIA GPU (the GPU tests skip "
                                                         "on the CPU, naming why)"),
    ("docs/attention.md", "## Context parallelism", 0): (
        RUN, _PY + "test_balance_then_context_parallelism_on_a_mesh"),
    ("docs/attention.md", "### Balance", 0): (
        RUN, _PY + "test_balance_then_context_parallelism_on_a_mesh"),
    ("docs/benchmarks.md", "## GPU: one NVIDIA H200 (2026-11-27)", 0): (NOT, _BENCH),
    ("docs/benchmarks.md", "## GPU: one NVIDIA H200 (2026-11-27)", 1): (NOT, _BENCH),
    ("docs/benchmarks.md", "## Importing a Hugging Face checkpoint: host memory", 0): (NOT, _BENCH),
    ("docs/benchmarks.md", "## Refactor: before and after", 0): (
        NOT, "checks two past revisions out and runs both (minutes); a record of how the figures "
             "were measured"),
    ("docs/benchmarks.md", "## Trainer restructure (objectives plug in): before and after",
     0): (NOT, "checks two past revisions out and runs both (minutes); a record of how the "
               "figures were measured"),
    ("docs/benchmarks.md", "## Rooms for the trainer: before and after (2026-11-26)", 0): (
        NOT, "checks two past revisions out and runs both (minutes); a record of how the figures "
             "were measured"),
    ("docs/benchmarks.md", _HEADING_BENCH, 0): (NOT, _BENCH),
    ("docs/benchmarks.md", _HEADING_BENCH, 2): (NOT, _BENCH),
    ("docs/benchmarks.md", "## A training step's peak memory: `python -m train.bench.memory` "
                           "(2026-11-27)", 0): (NOT, _BENCH),
    ("docs/benchmarks.md", "## Adapters: memory and QLoRA quality: `python -m train.bench.adapters` "
                           "(2026-11-27)", 0): (NOT, _BENCH),
    ("docs/hf.md", "# Hugging Face models in and out", 0): (
        SAME, (README, "## Fine-tune a Hugging Face model", 0), {}),
    ("docs/ingest.md", "# Tokenizing on Apache Beam", 0): (
        NOT, "installs a package (the test extra holds apache-beam and boto3)"),
    ("docs/ingest.md", "## Command lines", 0): (
        RUN, "tests/text/beam/test_beam_options.py"
             "::test_the_local_commands_of_docs_ingest_as_written"),
    ("docs/ingest.md", "## Command lines", 1): (
        NOT, "Dataflow, Flink and Spark clusters with their buckets; the flags parse "
             "(tests/house/test_docs_commands.py)"),
    ("docs/ingest.md", "## Command lines", 2): (
        RUN, "tests/text/beam/test_beam_remote.py::remote_dataset"),
    ("docs/ingest.md", "## Training on a remote dataset", 0): (
        RUN, "tests/text/beam/test_beam_remote.py"
             "::test_remote_dataset_trains_after_staging_and_stages_once"),
    ("docs/packing.md", "## Packers and plans (`segpack.packing`)", 0): (
        RUN, _PY + "test_the_packing_blocks"),
    ("docs/packing.md", "### Statistics CLI", 0): (RUN, _USE),
    ("docs/packing.md", "## Pipeline (`segpack.pack_dataset`)", 0): (
        RUN, _PY + "test_the_packing_blocks"),
    ("docs/packing.md", "### Rows", 0): (RUN, _PY + "test_the_timing_blocks_at_a_smaller_size"),
    ("docs/packing.md", "### Processes and elastic resume (`segpack.StreamBatches`)", 0): (
        RUN, _PY + "test_the_packing_blocks"),
    ("docs/packing.md", "### Mixtures (`segpack.Mixture`)", 0): (
        RUN, _PY + "test_the_packing_blocks"),
    ("docs/packing.md", "### Speed", 0): (RUN, _PY + "test_the_timing_blocks_at_a_smaller_size"),
    ("docs/training.md", "# Training", 0): (RUN, _TRAINING_BLOCKS),
    ("docs/training.md", "## Measured (CPU, 2 cores shared with other jobs, so upper bounds)", 0): (
        NOT, "the main job at full length (5 minutes) and what it printed: a record"),
    ("docs/training.md", "## See what it learned", 0): (RUN, _TRAINING_BLOCKS),
    ("docs/sft.md", "## Training: `configs/sft.py`", 0): (RUN, _TRAINING_BLOCKS),
    ("docs/sft.md", _OWN, 0): (SAME, (README, "## Fine-tune a Hugging Face model", 0), {}),
    ("docs/sft.md", _OWN, 1): (RUN, _SFT),
    ("docs/sft.md", _OWN, 2): (RUN, _SFT),
    ("docs/sft.md", "### Shards carry the mask", 0): (RUN, _SFT),
    ("docs/sft.md", "## Asking with tools", 0): (RUN, _SFT),
    ("docs/preference.md", "## Data: `segpack tokenize --format preference`", 0): (
        SAME, (README, "## Train on preferences", 0), {"MODEL_DIR": "exported"}),
    ("docs/rl.md", "# Reinforcement learning with verifiable rewards", 0): (
        SAME, (README, "## Reinforcement learning with verifiable rewards", 0),
        {"MODEL_DIR": "exported"}),
    ("docs/rl.md", "## Rewards: `--config.rl.rewards`", 0): (
        RUN, "tests/train/rl/test_rewards.py::test_the_docs_own_reward_runs"),
    ("docs/preference.md", "## The reference: computed once", 0): (
        RUN, "tests/train/preference/test_readme_dpo.py::test_readme_preference_commands"),
}


def test_every_block_is_accounted_for():
  found = [b.key for b in doc_blocks.blocks() if b.language in ("bash", "python")]
  assert len(found) == len(set(found))
  missing = [k for k in found if k not in INVENTORY]
  assert not missing, f"blocks no test runs and INVENTORY does not list: {missing}"
  stale = [k for k in INVENTORY if k not in found]
  assert not stale, f"INVENTORY lists blocks the documents no longer hold: {stale}"


def _function_source(path, name):
  tree = ast.parse((paths.REPO / path).read_text())
  for node in ast.walk(tree):
    if isinstance(node, ast.FunctionDef) and node.name == name:
      return ast.get_source_segment((paths.REPO / path).read_text(), node)
  raise AssertionError(f"{path} has no function {name}")


@pytest.mark.parametrize("key", sorted(k for k, v in INVENTORY.items() if v[0] == RUN))
def test_a_run_block_is_read_by_its_test(key):
  """The named test exists and names the block's heading (it reads the block, or the module's
  helper it calls does, by that heading)."""
  path, name = INVENTORY[key][1].split("::")
  source = _function_source(path, name)
  module = (paths.REPO / path).read_text()
  assert key[1] in source or (key[1] in module and name in module), (key, path, name)


@pytest.mark.parametrize("key", sorted(k for k, v in INVENTORY.items() if v[0] == SAME))
def test_a_same_block_holds_only_commands_that_run(key):
  _, target, subs = INVENTORY[key]
  assert INVENTORY[target][0] == RUN
  theirs = doc_blocks.block(*target).commands()
  for command in doc_blocks.block(*key).commands():
    for a, b in subs.items():
      command = command.replace(a, b)
    assert command in theirs, (key, command)


def test_not_run_says_why():
  for key, value in INVENTORY.items():
    if value[0] == NOT:
      assert len(value[1]) > 20, key


def test_ci_runs_the_readme_test_command():
  """The README's test command is the one `.ci/run` runs (CI runs it; a test cannot)."""
  (command,) = doc_blocks.block(README, "# segpack", 1).commands()
  assert command.startswith('pip install -e ".[test]" && python -m pytest') or command.startswith(
      "pip install -e '.[test]' && python -m pytest")
  ci = (paths.REPO / ".ci" / "run").read_text().strip().splitlines()[-1]
  assert ci == (paths.REPO / "README.md").read_text().split("```bash\n")[2].split("\n")[0]


def test_a_stale_inventory_is_caught(monkeypatch):
  """The negative control: a block the documents gain, or a same-block whose command differs."""
  extra = doc_blocks.Block("docs/new.md", "# New", 0, "bash", "python -m train.main\n")
  original = doc_blocks.blocks
  monkeypatch.setattr(doc_blocks, "blocks", lambda: [*original(), extra])
  with pytest.raises(AssertionError, match="INVENTORY does not list"):
    test_every_block_is_accounted_for()
  monkeypatch.undo()
  monkeypatch.setitem(INVENTORY, ("docs/hf.md", "# Hugging Face models in and out", 0),
                      (SAME, (README, "## Fine-tune with LoRA", 0), {}))
  with pytest.raises(AssertionError):
    test_a_same_block_holds_only_commands_that_run(("docs/hf.md", "# Hugging Face models in and out", 0))
