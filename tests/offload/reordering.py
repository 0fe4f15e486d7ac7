"""An I/O engine whose requests finish in a random order (seeded), for tests: ``reorder(monkeypatch, seed)``.

Every request ``FileIO.read``/``write`` is given is held back and runs, through the real engine, at a random moment
between its submission and its first wait: other requests held back run at random whenever one is submitted,
polled (``done``) or waited for, so an older request may land after a newer one, as the engine's workers allow. A
request may be cut in two pieces at a random byte that run at different moments (as its head, blocks and tail may).
A read's tensor is filled with 0xFF bytes (NaN) when it is submitted: bytes used before the read is waited for
show. With ``fail``, a piece fails with ``EIO`` at that rate, having moved nothing. ``FileIO.close`` runs what its
engine still holds.
"""

from __future__ import annotations

import errno
import random
from typing import Optional

import pytest
import torch

from zero_kernels.offload.aio import FileIO


class _Piece:
    def __init__(self, engine: "Reordering", io: FileIO, path: str, tensor: torch.Tensor, offset: int, write: bool):
        self.engine, self.io, self.path, self.tensor, self.offset, self.write = engine, io, path, tensor, offset, write
        self.finished, self.error = False, None

    def run(self) -> None:
        if self.finished:
            return
        self.finished = True
        self.engine.held.remove(self)
        if self.engine.rnd.random() < self.engine.fail:
            self.error = OSError(errno.EIO, "Input/output error (injected)", self.path)
        else:
            move = self.engine.real_write if self.write else self.engine.real_read
            try:
                move(self.io, self.path, self.tensor, self.offset).wait()
            except OSError as err:
                self.error = err
        self.tensor = None


class _Handle:
    """What ``FileIO.read``/``write`` return here: ``wait`` and ``done`` as ``IOHandle``'s."""

    def __init__(self, engine: "Reordering", path: str, pieces: list[_Piece]):
        self.engine, self.path, self.pieces = engine, path, pieces

    def done(self) -> bool:
        self.engine.progress()
        return all(p.finished for p in self.pieces)

    def wait(self) -> None:
        self.engine.progress()
        for piece in self.engine.rnd.sample(self.pieces, len(self.pieces)):
            piece.run()
        error = next((p.error for p in self.pieces if p.error is not None), None)
        if error is not None:
            raise error


class Reordering:
    """The requests held back and the seeded choices (see the module docstring)."""

    def __init__(self, seed: int, fail: float = 0.0):
        self.rnd = random.Random(seed)
        self.rate = self.rnd.choice((0.0, 0.05, 0.3))  # how often a request held back runs at each chance
        self.fail = fail
        self.held: list[_Piece] = []
        self.real_read, self.real_write, self.real_close = FileIO.read, FileIO.write, FileIO.close

    def progress(self) -> None:
        for piece in [p for p in self.held if self.rnd.random() < self.rate]:
            piece.run()

    def submit(self, io: FileIO, path: object, tensor: torch.Tensor, offset: int, write: bool) -> _Handle:
        self.progress()
        data = tensor.reshape(-1).view(torch.uint8)
        if not write:
            data.fill_(0xFF)
        cut: Optional[int] = (
            self.rnd.randrange(1, data.numel()) if data.numel() > 1 and self.rnd.random() < 0.3 else None
        )
        parts = [(tensor, offset)] if cut is None else [(data[:cut], offset), (data[cut:], offset + cut)]
        pieces = [_Piece(self, io, str(path), t, at, write) for t, at in parts]
        self.held += pieces
        return _Handle(self, str(path), pieces)

    def close(self, io: FileIO) -> None:
        for piece in [p for p in self.held if p.io is io]:
            piece.run()
        self.real_close(io)


def reorder(monkeypatch: pytest.MonkeyPatch, seed: int, fail: float = 0.0) -> Reordering:
    """Make ``FileIO`` finish its requests in a random order from ``seed`` (and fail a share ``fail`` of them) while
    ``monkeypatch`` lasts."""
    engine = Reordering(seed, fail)
    monkeypatch.setattr(
        FileIO, "read", lambda io, path, tensor, offset=0: engine.submit(io, path, tensor, offset, False)
    )
    monkeypatch.setattr(
        FileIO, "write", lambda io, path, tensor, offset=0: engine.submit(io, path, tensor, offset, True)
    )
    monkeypatch.setattr(FileIO, "close", lambda io: engine.close(io))
    return engine
