"""Two jobs, or two data-parallel groups of one job (``process_group=``), saving into one checkpoint root at the
same time: each numbered its version, wrote ``latest`` through the same temporary file and removed the other's
unfinished version, so one group's save failed with ``FileNotFoundError: latest.tmp`` ("nothing was changed",
though its version was published) and both groups' next load got the same group's model. A save holds the root's
lock (an flock on the root directory, dropped by the kernel when its process dies) from numbering its version to
``latest``: a second saver meanwhile is refused, naming the holder, and writes nothing.
"""

from __future__ import annotations

import errno
import fcntl
import os
from pathlib import Path

import pytest
import torch
from torch import nn

import zero_kernels.checkpoint as ck
import zero_kernels.optim as zo


def _trained() -> tuple[nn.Module, zo.ShardedFusedAdam]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    opt = zo.ShardedFusedAdam(model, lr=1e-2, stage=2)
    model(torch.randn(3, 4)).square().mean().backward()
    opt.step()
    return model, opt


def test_a_save_while_another_process_saves_into_the_same_root_is_refused(tmp_path: Path) -> None:
    model, opt = _trained()
    first = ck.save(tmp_path, model, opt)
    held = os.open(tmp_path, os.O_RDONLY)  # another job's rank 0, mid-save
    try:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(ck.CheckpointError, match="another process is saving into .*give each its own"):
            ck.save(tmp_path, model, opt)
        assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", first.name]
        assert (tmp_path / "latest").read_text() == first.name
    finally:
        os.close(held)
    second = ck.save(tmp_path, model, opt)  # the holder is gone: saves again, and its lock is released after
    assert (tmp_path / "latest").read_text() == second.name != first.name
    probe = os.open(tmp_path, os.O_RDONLY)
    try:
        fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)  # raises if the save kept its lock
    finally:
        os.close(probe)


def test_a_process_forked_during_a_save_does_not_keep_the_lock(tmp_path: Path) -> None:
    # a DataLoader's worker forked while a background thread saves: it inherited the lock's descriptor and held the
    # lock for its whole life, refusing every later save into the root
    model, opt = _trained()
    lock = ck.format.SaveLock(tmp_path)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: stays alive until the parent has tried its next save
        os.close(write)
        os.read(read, 1)
        os._exit(0)
    os.close(read)
    try:
        lock.release()
        saved = ck.save(tmp_path, model, opt)
        assert (tmp_path / "latest").read_text() == saved.name
    finally:
        os.close(write)
        os.waitpid(pid, 0)


@pytest.mark.parametrize("code", [errno.EBADF, errno.ENOSYS, errno.ENOLCK, errno.EOPNOTSUPP])
def test_a_root_whose_file_system_does_not_lock_still_saves(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, code: int
) -> None:
    # NFSv4 emulates flock with a byte-range lock, which needs a descriptor open for writing (a directory never is:
    # EBADF); Lustre mounted without -o flock answers ENOSYS: every save was refused as if another were under way
    flock = fcntl.flock

    def unsupported(fd: int, operation: int) -> None:
        if operation & fcntl.LOCK_EX:
            raise OSError(code, os.strerror(code))
        flock(fd, operation)

    monkeypatch.setattr(fcntl, "flock", unsupported)
    model, opt = _trained()
    with caplog.at_level("WARNING", logger="zero_kernels"):
        first = ck.save(tmp_path, model, opt)
        second = ck.save(tmp_path, model, opt)
    assert (tmp_path / "latest").read_text() == second.name != first.name
    assert caplog.text.count("cannot lock") == 1, caplog.text  # said once per root
    assert os.strerror(code) in caplog.text
    ck.load(tmp_path, model, opt)
