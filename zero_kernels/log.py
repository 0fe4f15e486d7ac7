"""The ``zero_kernels`` logger: its level from ``ZERO_KERNELS_LOG_LEVEL``, and a handler of last resort.

Python prints records of a logger without handlers only at WARNING and above (``logging.lastResort``),
so ``ZERO_KERNELS_LOG_LEVEL=INFO`` alone showed nothing. ``setup`` sets the level and adds one
handler that writes to stderr only while the application has configured no handler of its own on
the root logger: once it has (``logging.basicConfig``, a framework's set-up, before or after this
import), records reach it by propagation and this handler stays silent, so nothing prints twice.
"""

from __future__ import annotations

import logging

LOGGER_NAME = "zero_kernels"


class _LastResortHandler(logging.StreamHandler):
    """Writes to stderr only when the root logger has no handler (the application configured none)."""

    def emit(self, record: logging.LogRecord) -> None:
        if not logging.getLogger().handlers:
            super().emit(record)


def setup(level: str) -> logging.Logger:
    """Set the ``zero_kernels`` logger's level and give it the handler of last resort (once).

    Args:
        level: ``DEBUG``, ``INFO``, ``WARNING`` or ``ERROR``.
    """
    logger = logging.getLogger(LOGGER_NAME)
    logger.setLevel(level)
    if not any(isinstance(h, _LastResortHandler) for h in logger.handlers):
        handler = _LastResortHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        logger.addHandler(handler)
    return logger
