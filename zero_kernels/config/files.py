"""Where a DeepSpeed config comes from: a mapping, a JSON file's path, or a base64-encoded JSON string.

As DeepSpeed reads them: a file is strict JSON, or else hjson (``//`` comments, trailing commas), which
DeepSpeed always uses; ``hjson`` is not a requirement here, so without it a file that is not strict JSON is
an error saying so. A string that is no file's path is taken as a base64-encoded config (DeepSpeed's
``urlsafe_b64decode``; the standard alphabet passes too) when it decodes to a JSON object. Duplicate keys are
refused, as DeepSpeed refuses them.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Dict, Optional, Union

__all__ = ["load"]

_ACCEPTED = "pass a dict, the path of a JSON file, or a base64-encoded JSON string"


def load(source: Union[str, os.PathLike, Mapping]) -> Mapping:
    """The config as a mapping: given as one, read from a file, or decoded from base64.

    Args:
        source: a mapping, a path (``str`` or ``os.PathLike``), or a base64-encoded JSON string.
    """
    if isinstance(source, Mapping):
        return source
    if not isinstance(source, (str, os.PathLike)):
        raise ValueError(f"DeepSpeed config must be a file path or a mapping, not {type(source).__name__}")
    if not os.fspath(source).strip():
        raise ValueError(f"the DeepSpeed config is empty ({os.fspath(source)!r}): {_ACCEPTED}")
    path = Path(source)
    if path.is_dir():
        raise ValueError(f"the DeepSpeed config path {str(path)!r} is a directory: {_ACCEPTED}")
    if path.is_file():
        return _parse(path.read_text(encoding="utf-8"), f"DeepSpeed config file {str(path)!r}")
    decoded = _base64(source) if isinstance(source, str) else None
    if decoded is None:
        raise ValueError(
            f"DeepSpeed config file {str(path)!r} does not exist or is not a file (nor is it a base64-encoded config)"
        )
    return _parse(decoded, "the base64-encoded DeepSpeed config")


def _base64(text: str) -> Optional[str]:
    """``text`` decoded, if it is base64 (URL-safe or standard alphabet) of UTF-8 text that opens a JSON object."""
    try:
        decoded = base64.b64decode(text.strip().translate(str.maketrans("-_", "+/")), validate=True).decode("utf-8")
    except (binascii.Error, UnicodeDecodeError, ValueError):
        return None
    return decoded if decoded.lstrip().startswith("{") else None


def _parse(text: str, what: str) -> Dict[str, Any]:
    if not text.strip():
        raise ValueError(f"{what} is empty: it must hold a JSON object")
    try:
        data = json.loads(text, object_pairs_hook=_no_duplicates)
    except json.JSONDecodeError as err:
        data = _hjson(text, what, f"{err.msg} at line {err.lineno}, column {err.colno}")
    except ValueError as err:
        raise ValueError(f"{what}: {err}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{what} holds a {type(data).__name__}, expected a JSON object")
    return data


def _hjson(text: str, what: str, json_error: str) -> Any:
    """``text`` read with hjson, as DeepSpeed reads every config; without hjson an error saying so."""
    try:
        import hjson
    except ImportError:
        raise ValueError(
            f"{what} is not valid JSON: {json_error}. DeepSpeed reads configs with hjson (// comments, trailing "
            "commas): pip install hjson to read it so here too, or write strict JSON"
        ) from None
    try:
        return hjson.loads(text, object_pairs_hook=_no_duplicates)
    except hjson.HjsonDecodeError as err:
        raise ValueError(f"{what} is not valid JSON ({json_error}) nor hjson ({err})") from None
    except ValueError as err:
        raise ValueError(f"{what}: {err}") from None


def _no_duplicates(pairs: Any) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r} in the DeepSpeed config")
        out[key] = value
    return out
