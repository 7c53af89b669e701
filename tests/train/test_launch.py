"""`train.launch.what_next`, a finished run's last lines: the wall time and the commands that
read the run, with its workdir and the prompt flags its data takes (ids for a synthetic run,
`--chat` for conversations, text otherwise; `--adapter` for a LoRA run's export)."""

from configs import packed, sft
from support.train_configs import synthetic_config
from train import launch


def _lines(config, workdir="runs/x", wall_s=12.34):
  return launch.what_next(config, workdir, wall_s=wall_s).splitlines()


def test_the_last_lines_name_the_commands_with_the_runs_workdir():
  head, sample, plot, board, export = _lines(packed.get_config("smoke"), "runs/packed_smoke")
  assert head == ("python -m train.main: done in 12.3 s of wall time; runs/packed_smoke holds "
                  "the run. Next:")
  assert sample.split("#")[0].split() == ["python", "-m", "train.sample", "--workdir",
                                         "runs/packed_smoke", "--prompt", '"def', '"']
  assert plot.split("#")[0].split() == ["python", "-m", "train.plot", "runs/packed_smoke"]
  assert "runs/packed_smoke/tensorboard" in board
  assert export.split("#")[0].split()[-2:] == ["--output", "exported"]
  assert len({line.index("#") for line in (sample, plot, board, export)}) == 1  # one column


def test_the_prompt_flags_follow_the_data_and_an_adapter_run_exports_its_adapter():
  assert "--prompt_ids 1,5,6,7" in _lines(synthetic_config())[1]
  chat = sft.get_config("smoke")
  assert '--chat --prompt "What does zip do?"' in _lines(chat)[1]
  assert "--adapter" not in _lines(chat)[4]
  with chat.unlocked():
    chat.model.lora.rank = 4
  assert "--output exported --adapter" in _lines(chat)[4]
  assert "done;" in _lines(chat, wall_s=None)[0]
