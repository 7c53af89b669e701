"""python -m train.bench steps and gpu-numbers: the profile's kernel times against a hand-made
trace, overrides, a tiny step run against transformers' parameter count, the GPU command's
stages (argv parsed by each command's own parser; one stage run at toy size)."""

import cProfile
import gzip
import json
import time

import pytest

from segpack import errors
from segpack.bench import attention as attention_bench
from segpack.bench import gpu_report
from train.bench import gpu_numbers
from train.bench import steps
from train.bench import training

# Device process 7 with a kernel line ("Stream #1") and an XLA op line; host process 1.
TRACE = {"traceEvents": [
    {"ph": "M", "pid": 7, "name": "process_name", "args": {"name": "/device:GPU:0"}},
    {"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/host:CPU"}},
    {"ph": "M", "pid": 7, "tid": 2, "name": "thread_name", "args": {"name": "Stream #1(Compute)"}},
    {"ph": "M", "pid": 7, "tid": 3, "name": "thread_name", "args": {"name": "XLA Ops"}},
    {"ph": "M", "pid": 1, "tid": 2, "name": "thread_name", "args": {"name": "Stream #1"}},
    {"ph": "X", "pid": 7, "tid": 2, "ts": 0, "dur": 3000.0, "name": "nvjet_sm90_tst_TNN"},
    {"ph": "X", "pid": 7, "tid": 2, "ts": 5, "dur": 1000.0, "name": "segment_flash_bwd_dkv"},
    {"ph": "X", "pid": 7, "tid": 2, "ts": 9, "dur": 1000.0, "name": "nvjet_sm90_tst_TNN"},
    {"ph": "X", "pid": 7, "tid": 2, "ts": 12, "dur": 500.0, "name": "loop_add_fusion_3"},
    {"ph": "X", "pid": 7, "tid": 2, "ts": 14, "dur": 500.0, "name": "memcpy128"},
    {"ph": "X", "pid": 7, "tid": 3, "ts": 0, "dur": 9999.0, "name": "dot.3"},  # op line: no kernel
    {"ph": "X", "pid": 1, "tid": 2, "ts": 0, "dur": 7777.0, "name": "python"},  # host: no kernel
]}


def test_profile_summary_sums_device_stream_kernels_only(tmp_path):
  run = tmp_path / "plugins" / "profile" / "2026_11_27"
  run.mkdir(parents=True)
  with gzip.open(run / "perfetto_trace.json.gz", "wt") as f:
    json.dump(TRACE, f)
  got = steps.profile_summary(str(tmp_path), steps=2, top=2)
  assert got["kernel_ms_per_step"] == pytest.approx(3.0)  # 6000 us over 2 steps
  assert got["kernel_groups_ms_per_step"] == pytest.approx(
      dict(matmul=2.0, attention=0.5, fusion=0.25, copy=0.25))
  assert [k["kernel"] for k in got["top_kernels"]] == ["nvjet_sm90_tst_TNN",
                                                       "segment_flash_bwd_dkv"]
  assert got["top_kernels"][0]["share"] == pytest.approx(4000 / 6000)
  assert steps.profile_summary(str(tmp_path / "none"), steps=1, top=3)["top_kernels"] == []


def test_setup_summary_ranks_own_code_by_cumulative_and_any_code_by_own_time():
  def setup_like():
    time.sleep(0.2)  # a wait in a library call: its own time, not the caller's
    return steps.load_config("configs/packed.py:smoke")
  profiler = cProfile.Profile()
  profiler.runcall(setup_like)
  got = steps.setup_summary(profiler, top=3)
  assert "sleep" in got["self"][0]["function"] and got["self"][0]["seconds"] >= 0.15
  own = [r["function"] for r in got["own"]]
  assert "bench/steps.py:load_config" in own  # the trainer's own function, by cumulative time
  assert not any("sleep" in f or "site-packages" in f for f in own)  # libraries stay out of own
  assert len(got["own"]) <= 3 and got["own"] == sorted(got["own"], key=lambda r: -r["seconds"])


def test_overrides_are_typed_and_mistakes_name_the_item():
  config = steps.load_config("configs/packed.py:smoke")
  steps.apply_overrides(config, ["train.batch_size=4", "model.dtype=bfloat16",
                                 "loss.block_size=64", "attention.self_check=False"])
  assert (config.train.batch_size, config.model.dtype, config.loss.block_size) == (4, "bfloat16",
                                                                                   64)
  assert config.attention.self_check is False
  for bad, said in (("train.batch_sizes=4", "train.batch_sizes"), ("train.batch_size",
                                                                  "KEY=VALUE"),
                    ("train.batch_size=four", "train.batch_size=four")):
    with pytest.raises(errors.ArgumentError, match=said):
      steps.apply_overrides(config, [bad])
  with pytest.raises(errors.ArgumentError, match="configs/nope.py"):
    steps.load_config("configs/nope.py:gpu")


def test_steps_on_a_hugging_face_config_count_transformers_parameters(tmp_path, capsys):
  transformers = pytest.importorskip("transformers")
  torch = pytest.importorskip("torch")
  hf = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True,
            max_position_embeddings=1024)
  transformers.LlamaConfig(**hf).save_pretrained(tmp_path / "hf")
  with torch.device("meta"):
    want = transformers.LlamaForCausalLM(transformers.LlamaConfig(**hf)).num_parameters()
  argv = ["steps", "--config", "configs/packed.py", "--hf-config", str(tmp_path / "hf"),
          "--workdir", str(tmp_path / "run"), "--warmup", "1", "--steps", "2", "--json"]
  for item in ("data.source=synthetic", "data.synthetic_vocab=512", "data.synthetic_docs=64",
               "data.synthetic_mean_len=40", "packing.seq_len=64", "train.batch_size=8",
               "train.eval_every=0", "train.log_batches=False"):
    argv += ["--set", item]
  assert training.main(argv) == 0
  rec = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
  assert rec["params"] == want  # the architecture came from config.json (no weights read)
  assert rec["slots"] == 2 * 8 * 64 and 0 < rec["real_tokens"] <= rec["slots"]
  assert rec["mfu"] is None  # no known peak on the CPU, never a made-up figure
  assert rec["model_flops_per_s"] > 0 and rec["real_tokens_per_s"] > 0


def test_gpu_numbers_stages_parse_and_a_stage_runs_at_toy_size(tmp_path):
  for stage in gpu_numbers.stages(tmp_path):
    for argv in (stage.argv, stage.dry_argv):
      if argv[:3] == ("segpack", "bench", "attention"):
        args = attention_bench.parse_args(list(argv[3:]))
        assert args.json and args.seq_lens
      elif argv[:3] == ("segpack", "bench", "gpu-report"):
        assert gpu_report.parse_args(list(argv[3:])).quick
      elif argv[0] == "train.bench":
        assert training.build_parser().parse_args(list(argv[1:])).benchmark == "steps"
      else:
        assert argv[0] == "train.main" and any(a.startswith("--config=configs/") for a in argv)
  report = gpu_numbers.collect(out=tmp_path / "out", dry=True, budget=120, only=["gpu_report"])
  saved = json.loads((tmp_path / "out" / "gpu_numbers.json").read_text())
  assert saved["stages"]["gpu_report"]["status"] == "ok" == report["stages"]["gpu_report"]["status"]
  assert saved["stages"]["gpu_report"]["result"]["checks"]
  assert json.loads((tmp_path / "out" / "llama_1b" / "config.json").read_text())[
      "num_hidden_layers"] == 16
  # A spent budget leaves the rest "not run", and says so.
  report = gpu_numbers.collect(out=tmp_path / "out2", dry=True, budget=10)
  assert {r["status"] for r in report["stages"].values()} == {
      "not run: the time budget was spent"}
