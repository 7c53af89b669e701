"""segpack.files.file_lock's refusal names the process that holds the lock, also in the moment
between the holder taking the lock and writing its record.

Oracle: the pid the test's own holder writes (a separate open file of the same path holds the
flock, as another process's would); negative controls: a record that never comes, and the record
of an earlier holder that has exited.
"""

import fcntl
import json
import socket
import subprocess
import sys
import threading
import time

import pytest

from segpack import files


def _record(pid):
  return json.dumps({"pid": pid, "host": socket.gethostname(), "started": "then"}).encode()


def _hold(path, *, write_after_s, pid, stale_pid=None):
  """Takes the lock as another process would (its own open file), with a stale record in the
  file when `stale_pid`; writes its own record `write_after_s` later (never when None)."""
  f = open(path, "a+b")  # noqa: SIM115  # closed by the caller's f.close()
  if stale_pid is not None:
    f.write(_record(stale_pid))
    f.flush()
  fcntl.flock(f.fileno(), fcntl.LOCK_EX)
  if write_after_s is not None:
    def write():
      time.sleep(write_after_s)
      f.seek(0)
      f.truncate()
      f.write(_record(pid))
      f.flush()
    threading.Thread(target=write, daemon=True).start()
  return f


def _dead_pid():
  proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                        capture_output=True, text=True, check=True)
  return int(proc.stdout)


@pytest.mark.parametrize("stale", [False, True], ids=["empty_file", "earlier_holders_record"])
def test_a_refusal_waits_for_the_new_holders_record(tmp_path, stale):
  path = tmp_path / "x.lock"
  # pid 1 (alive) is the holder's stand-in
  holder = _hold(path, write_after_s=0.3, pid=1, stale_pid=_dead_pid() if stale else None)
  try:
    with pytest.raises(files.LockHeldError) as e:
      with files.file_lock(path, wait=False):
        pass
    assert e.value.owner.startswith("pid 1 on host "), e.value.owner
  finally:
    holder.close()


def test_a_holder_that_never_writes_is_reported_as_such_after_a_moment(tmp_path):
  path = tmp_path / "x.lock"
  holder = _hold(path, write_after_s=None, pid=1, stale_pid=_dead_pid())
  try:
    started = time.monotonic()
    with pytest.raises(files.LockHeldError) as e:
      with files.file_lock(path, wait=False):
        pass
    assert e.value.owner == "its pid is not recorded in the lock file"
    assert time.monotonic() - started < 5
  finally:
    holder.close()


def test_the_lock_is_taken_once_the_holder_lets_go(tmp_path):
  path = tmp_path / "x.lock"
  holder = _hold(path, write_after_s=None, pid=1)
  holder.close()
  with files.file_lock(path, wait=False):
    record = json.loads(path.read_bytes())
  assert record["pid"] != 1 and record["host"] == socket.gethostname()


def test_an_atomic_write_that_must_not_replace_refuses_a_file_that_is_there(tmp_path):
  path = tmp_path / "out.jsonl"
  files.atomic_write_bytes(path, b"first\n", replace=False)
  assert path.read_bytes() == b"first\n"
  with pytest.raises(FileExistsError):
    files.atomic_write_bytes(path, b"second\n", replace=False)
  assert path.read_bytes() == b"first\n" and sorted(p.name for p in tmp_path.iterdir()) == [
      "out.jsonl"]  # no temporary left
  files.atomic_write_bytes(path, b"second\n")  # the default replaces
  assert path.read_bytes() == b"second\n"
