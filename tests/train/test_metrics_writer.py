"""The metrics writer's TensorBoard events are written without importing PyTorch (tensorboardX
imports it whenever it is installed, a second of every run's start), and torch stays importable."""

import subprocess
import sys

from support import paths


def test_tensorboard_events_without_torch_and_torch_still_importable(tmp_path):
  code = (
      "import sys, os\n"
      "from train import metrics\n"
      f"w = metrics.MetricsWriter({str(tmp_path)!r}, echo=False)\n"
      "w.write(dict(kind='eval', step=3, eval_loss=1.5, eval_tokens=10))\n"
      "w.close()\n"
      "print('torch' in sys.modules)\n"
      "import torch\n"
      "print(hasattr(torch, 'Tensor'))\n")
  out = subprocess.run([sys.executable, "-c", code], cwd=paths.REPO, capture_output=True,
                       text=True, timeout=300, env={"PYTHONPATH": str(paths.REPO),
                                                    "PATH": "/usr/bin:/bin"})
  assert out.returncode == 0, out.stderr[-2000:]
  assert out.stdout.split() == ["False", "True"]
  events = list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
  assert events and events[0].stat().st_size > 0
