"""DeepSpeed's logging and monitoring blocks: accepted with their values checked as DeepSpeed 0.19 types them
(``deepspeed/monitor/config.py``, ``deepspeed/comm/config.py``: objects with fixed keys), never acted on.

``tensorboard``, ``wandb``, ``csv_monitor`` and ``comet`` make DeepSpeed's engine write its loss, learning rate
and loss scale to that backend; ``comms_logger`` makes ``deepspeed.comm`` time and log its collectives. zero_kernels
is an optimizer, not an engine: it writes none of them, and a block that turns one on is logged in the WARNING
line of keys without effect (INFO when it turns nothing on). ``monitor_config`` and ``comms_config`` are read by no
DeepSpeed release (it ignores unknown top-level keys); templates such as LLaMA-Factory's ALST one write them, so
they are accepted as DeepSpeed accepts them, whatever their value.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, Dict

from .rules import Field, Section, Unused, boolean, integer, names, text

INFO = logging.INFO


def _off(value: Any) -> bool:
    """A block that does not write ``"enabled": true`` turns nothing on (every one of them defaults to off)."""
    return not (isinstance(value, Mapping) and value.get("enabled") is True)


def _block(fields: Dict[str, Field]) -> Section:
    return Section(fields={"enabled": Field(boolean(), False), **fields})


_FILES = {"output_path": Field(text(), ""), "job_name": Field(text(), "DeepSpeedJobName")}
_COMET_TEXT = ("project", "workspace", "api_key", "experiment_name", "experiment_key", "mode")

TENSORBOARD = _block(_FILES)
CSV_MONITOR = _block(_FILES)
WANDB = _block(
    {"group": Field(text(nullable=True)), "team": Field(text(nullable=True)), "project": Field(text(), "deepspeed")}
)
COMET = _block(
    {
        "samples_log_interval": Field(integer(), 100),
        **{key: Field(text(nullable=True)) for key in _COMET_TEXT},
        "online": Field(boolean()),
    }
)
COMMS_LOGGER = _block(
    {
        "prof_all": Field(boolean(), True),
        "prof_ops": Field(names(), ()),
        "verbose": Field(boolean(), False),
        "debug": Field(boolean(), False),
    }
)

UNUSED: Dict[str, Unused] = {
    "tensorboard": Unused(TENSORBOARD, quiet=_off),
    "wandb": Unused(WANDB, quiet=_off),
    "csv_monitor": Unused(CSV_MONITOR, quiet=_off),
    "comet": Unused(COMET, quiet=_off),
    "comms_logger": Unused(COMMS_LOGGER, quiet=_off),
    "monitor_config": Unused(None, quiet=_off),
    "comms_config": Unused(None, level=INFO),
}
