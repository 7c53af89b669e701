"""train.bench.revisions: the comparison flags a changed loss bit or batch fingerprint and passes
equal runs whose times differ; a revision git does not know ends with one line, exit status 2.
(The real comparison checks out two revisions and trains; it is not run here.)"""

import subprocess

import numpy as np

from train.bench import compare as bench_compare
from train.bench import revisions as br


def _metrics(loss: float, wall: float) -> list[dict]:
  return [{"kind": "eval", "step": 0, "eval_loss": 7.6345, "eval_tokens": 2032},
          {"kind": "train", "step": 1, "loss": loss, "grad_norm": 0.78, "elapsed_s": wall,
           "real_tokens_per_s": 1000.0 / wall, "mfu": None},
          {"kind": "summary", "final_loss": loss, "wall_s": wall, "workdir": f"/tmp/{wall}"}]


def _batch(fingerprint: str, position: dict) -> dict:
  return {"step": 1, "fingerprint": fingerprint, "rows": ["9ec2588e506545ee"],
          "position": position, "plan_rows": [[0, 2264]]}


OLD_POSITION = {"epoch": 0, "index": 8, "rows_per_epoch": 3489}
NEW_POSITION = {"version": 1, "unit": "rows", "epoch": 0, "index": 8, "epoch_length": 3489}


def _run(loss: float, fingerprint: str, wall: float, position: dict = NEW_POSITION) -> bench_compare.Run:
  metrics = [bench_compare.comparable({k: v for k, v in r.items() if k != "workdir"})
             for r in _metrics(loss, wall)]
  batches = [bench_compare.comparable(dict(_batch(fingerprint, bench_compare.stream_position(position))))]
  return bench_compare.Run(parts={"batch fingerprints": batches, "metrics": metrics},
                times={"trainer's wall_s": wall}, what="test", wall=wall + 5)


def test_equal_runs_with_other_times_and_the_old_position_format_are_identical():
  before = _run(6.326420783996582, "f31bb3a595fec33a", wall=7.0, position=OLD_POSITION)
  after = _run(6.326420783996582, "f31bb3a595fec33a", wall=11.1)
  for label in before.parts:
    assert bench_compare.first_difference(before.parts[label], after.parts[label]) is None
  rows = bench_compare.table_rows({"train": [("before", 0, before), ("after", 0, after)]})
  assert all(r["identical"] is not False for r in rows)
  head = rows[0]
  assert head["identical"] is True and head["before_s"] == 12.0 and head["after_s"] == 16.1
  timed = next(r for r in rows if r["compared"].strip() == "trainer's wall_s")
  assert timed["identical"] is None and abs(timed["ratio"] - 11.1 / 7.0) < 1e-12


def test_a_changed_last_bit_of_a_loss_differs():
  loss = 6.326420783996582
  bumped = float(np.nextafter(loss, np.inf))
  assert bumped != loss and abs(bumped - loss) < 1e-15
  before, after = _run(loss, "f31bb3a595fec33a", 7.0), _run(bumped, "f31bb3a595fec33a", 7.0)
  found = bench_compare.first_difference(before.parts["metrics"], after.parts["metrics"], "metrics")
  assert found is not None and found.startswith("metrics[1].loss:"), found
  rows = bench_compare.table_rows({"train": [("before", 0, before), ("after", 0, before),
                                  ("after", 1, after), ("before", 1, before)]})
  assert rows[0]["identical"] is False
  assert rows[0]["difference"].startswith("after, repeat 2: metrics[1].loss:"), rows[0]
  assert " NO " in bench_compare.format_table(rows)


def test_a_changed_batch_fingerprint_differs():
  before, after = _run(6.3, "f31bb3a595fec33a", 7.0), _run(6.3, "f31bb3a595fec33b", 7.0)
  found = bench_compare.first_difference(before.parts["batch fingerprints"],
                              after.parts["batch fingerprints"], "batches")
  assert found == "batches[0].fingerprint: 'f31bb3a595fec33a' != 'f31bb3a595fec33b'"


def test_first_difference_types_signs_missing_keys_and_lengths():
  assert bench_compare.first_difference(0.0, -0.0) is not None
  assert bench_compare.first_difference(1, 1.0) is not None
  assert bench_compare.first_difference(float("nan"), float("nan")) is None
  assert bench_compare.first_difference({"rows": 3}, {"rows": 3, "tokens": 5}) == "tokens: '<absent>' != 5"
  assert bench_compare.first_difference([1, 2], [1, 2, 3], "x") == "x: 2 items != 3"
  assert bench_compare.first_difference({"a": [1, {"b": True}]}, {"a": [1, {"b": 1}]}) == "a[1].b: True != 1"


def test_comparable_drops_measured_fields_and_renames_rows():
  row = {"section": "repack", "case": "repack epoch 2+, TiePlanner", "rows": 3927,
         "seconds": 0.05, "cpu_seconds": 0.05, "docs_per_s": 3e5, "peak_rss": 1, "wall_s": 1.0,
         "bytes_per_doc": 11.7, "rows_over_bound": 1.0, "model": {"params": 1.2e9, "x_s": 2}}
  assert bench_compare.comparable(row) == {"section": "repack", "case": "repack epoch 2+, RepackPlanner",
                                "rows": 3927, "bytes_per_doc": 11.7, "rows_over_bound": 1.0,
                                "model": {"params": 1.2e9}}


def test_a_revision_git_does_not_know_is_one_line_and_status_2(capsys):
  repo = br.repository()
  def ours() -> int:  # worktrees this command made
    listed = subprocess.run(["git", "-C", repo, "worktree", "list"], capture_output=True,
                            text=True, check=True).stdout
    return listed.count("bench-revisions-")
  made = ours()
  assert br.main(["--before", "no-such-revision-of-segpack", "--after", "HEAD"]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1, err
  assert err[0].startswith("python -m train.bench.revisions: error: --before "
                           "'no-such-revision-of-segpack'"), err
  assert br.main(["--before", "HEAD", "--after=-p"]) == 2  # an option is no revision
  assert "--after '-p'" in capsys.readouterr().err
  assert ours() == made  # nothing was checked out
