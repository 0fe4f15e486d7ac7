"""Offload: the disk I/O engine that moves tensors between host memory and files (``aio``)."""

from .aio import FileIO, IOHandle

__all__ = ["FileIO", "IOHandle"]
