"""The Python objects a checkpoint holds, in one lossless encoding that loads safely.

Besides tensor bytes a checkpoint keeps objects: the param groups, the lr scheduler's
``state_dict()``, the fp16 loss scale, the accumulation window's bookkeeping (``objects.pt``) and
the user's ``extra`` (``extra.pt``). A JSON round trip changes them (a ``MultiStepLR``'s milestones,
a ``Counter`` of ints, came back keyed by strings and the lr never decayed; tuples became lists,
tensors numbers), so they are written with ``torch.save`` and read with
``torch.load(weights_only=True)``, which never runs code from the file. What that loader takes in
every torch this package supports (tensors, numbers, strings, bytes, ``None``, dicts, lists, tuples,
``OrderedDict``, dtypes, ``torch.Size``) is written as is; the other types a state commonly holds
are written as tagged tuples of those, and decoding turns exactly these tags back into objects:

==================  ===========================================
``Counter``         ``(TAG, "Counter", [[key, count], ...])``
``defaultdict``     ``(TAG, "defaultdict", factory, [[key, value], ...])`` with factory among list,
                    dict, set, int, float, str
``set``             ``(TAG, "set", [...])``, ``frozenset`` likewise
``torch.device``    ``(TAG, "device", "cuda:0")``
a tuple that starts with ``TAG`` itself: ``(TAG, "tuple", [...])``
==================  ===========================================

Anything else (a function, a custom class) is refused when saved, naming where it is
(``scheduler state_dict()['lr_lambdas'][0]``). Checkpoints written before ``objects.pt`` existed
kept the scheduler's state as JSON: ``from_json`` restores the types it lost where the scheduler
being loaded shows them (integer keys, tuples, counters, tensors).
"""

from __future__ import annotations

import io
import zlib
from collections import Counter, OrderedDict, defaultdict
from pathlib import Path
from typing import Any, Optional

import torch

from .format import CheckpointError

TAG = "zero_kernels.checkpoint.object"
_FACTORIES = {f.__name__: f for f in (list, dict, set, int, float, str)}
_LEAVES = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.Size)
_ALLOWED = (
    "tensors, numbers, strings, bytes, None, dicts, lists, tuples, OrderedDict, Counter, defaultdict, set, "
    "frozenset, torch.dtype, torch.Size and torch.device"
)


def encode(obj: Any, where: str) -> Any:
    """``obj`` made of what ``torch.load(weights_only=True)`` reads (see the module docstring).

    Args:
        obj: the object to save.
        where: how an error names ``obj`` (``"the scheduler's state_dict()"``).
    """
    kind = type(obj)
    if kind in _LEAVES or isinstance(obj, torch.Tensor) and kind in (torch.Tensor, torch.nn.Parameter):
        return obj
    if kind is list:
        return [encode(v, f"{where}[{i}]") for i, v in enumerate(obj)]
    if kind is tuple:
        items = [encode(v, f"{where}[{i}]") for i, v in enumerate(obj)]
        return (TAG, "tuple", items) if obj and type(obj[0]) is str and obj[0] == TAG else tuple(items)
    if kind in (dict, OrderedDict):
        return kind((encode(k, f"{where} key {k!r}"), encode(v, f"{where}[{k!r}]")) for k, v in obj.items())
    if kind is Counter:
        return (TAG, "Counter", _pairs(obj, where))
    if kind is defaultdict and obj.default_factory in _FACTORIES.values():
        return (TAG, "defaultdict", obj.default_factory.__name__, _pairs(obj, where))
    if kind in (set, frozenset):
        return (TAG, kind.__name__, [encode(v, f"{where} element") for v in obj])
    if kind is torch.device:
        return (TAG, "device", str(obj))
    raise CheckpointError(
        f"checkpoint: {where} is of type {kind.__module__}.{kind.__qualname__}, which cannot be saved: checkpoint "
        f"objects are read back with torch.load(weights_only=True) and may hold only {_ALLOWED}"
    )


def _pairs(mapping: Any, where: str) -> list[list[Any]]:
    return [[encode(k, f"{where} key {k!r}"), encode(v, f"{where}[{k!r}]")] for k, v in mapping.items()]


def decode(obj: Any) -> Any:
    """The objects ``encode`` wrote; a tag it does not know raises ``CheckpointError``."""
    kind = type(obj)
    if kind is list:
        return [decode(v) for v in obj]
    if kind in (dict, OrderedDict):
        return kind((decode(k), decode(v)) for k, v in obj.items())
    if kind is not tuple:
        return obj
    if not (len(obj) >= 2 and type(obj[0]) is str and obj[0] == TAG):
        return tuple(decode(v) for v in obj)
    name, args = obj[1], obj[2:]
    if name == "tuple" and len(args) == 1:
        return tuple(decode(v) for v in args[0])
    if name == "Counter" and len(args) == 1:
        return Counter({decode(k): decode(v) for k, v in args[0]})
    if name == "defaultdict" and len(args) == 2 and args[0] in _FACTORIES:
        return defaultdict(_FACTORIES[args[0]], {decode(k): decode(v) for k, v in args[1]})
    if name in ("set", "frozenset") and len(args) == 1:
        return (set if name == "set" else frozenset)(decode(v) for v in args[0])
    if name == "device" and len(args) == 1 and isinstance(args[0], str):
        return torch.device(args[0])
    raise CheckpointError(f"checkpoint: an object is tagged {name!r} with {len(args)} arguments, which is not known")


def dumps(obj: Any, where: str) -> bytes:
    """``obj`` encoded and ``torch.save``-d, once it is known that ``loads`` reads it back."""
    data = io.BytesIO()
    torch.save(encode(obj, where), data)
    loads(data.getvalue(), where)
    return data.getvalue()


def _here(storage: Any, location: str) -> Any:
    """Where a saved tensor comes back: one saved from a GPU on this process's current GPU (every rank reads what
    rank 0 wrote: not on rank 0's device), on the CPU where there is none; any other on the CPU."""
    if location.startswith("cuda") and torch.cuda.is_available():
        return storage.cuda(torch.cuda.current_device())
    return storage


def loads(data: bytes, what: str) -> Any:
    """Objects written by ``dumps``, or by ``torch.save`` alone (earlier ``extra.pt`` files); never runs code.

    Args:
        data: the bytes of the file.
        what: the file, for the message.
    """
    try:
        return decode(torch.load(io.BytesIO(data), weights_only=True, map_location=_here))
    except CheckpointError:
        raise
    except Exception as err:  # UnpicklingError for a refused object; others for a damaged archive or deep nesting
        first_line = (str(err).splitlines() or [""])[0]
        raise CheckpointError(
            f"checkpoint: {what} cannot be loaded safely with torch.load(weights_only=True) "
            f"({type(err).__name__}: {first_line}); it may hold only {_ALLOWED}"
        ) from err


def read_file(version: Path, name: str, entry: Optional[dict]) -> Any:
    """The objects of file ``name`` of ``version`` (None when ``entry`` is), checked against its size and CRC.

    Args:
        version: the version directory.
        name: the file's name there.
        entry: the metadata's entry for it (``bytes``, ``crc32``), or None.
    """
    if entry is None:
        return None
    path = version / name
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint: {path} is missing") from None
    data = path.read_bytes() if size == entry["bytes"] else b""
    if size != entry["bytes"] or zlib.crc32(data) != entry["crc32"]:
        raise CheckpointError(f"checkpoint: {path} is truncated or corrupted (size or checksum mismatch)")
    return loads(data, str(path))


def from_json(saved: Any, template: Any) -> Any:
    """A value a JSON round trip changed, with the types ``template`` (the live object's value) shows.

    Dict keys become the template's keys they spell (``"30"`` -> ``30``; a template keyed by integers
    turns other digit strings into integers too), a dict becomes the template's mapping type
    (``Counter``, ``OrderedDict``), a list a tuple where the template has one, a number a tensor where the
    template has one (its dtype); the rest is kept.
    """
    if isinstance(template, dict) and isinstance(saved, dict):
        keys = {str(k): k for k in template}
        ints = bool(template) and all(type(k) is int for k in template)
        out = {}
        for k, v in saved.items():
            key = keys.get(k, int(k) if ints and isinstance(k, str) and k.lstrip("-").isdigit() else k)
            out[key] = from_json(v, template[key]) if key in template else v
        if isinstance(template, defaultdict):
            return defaultdict(template.default_factory, out)
        return type(template)(out) if type(template) in (Counter, OrderedDict) else out
    if isinstance(template, (list, tuple)) and isinstance(saved, list):
        items = [from_json(v, t) for v, t in zip(saved, template)] + saved[len(template) :]
        return tuple(items) if isinstance(template, tuple) else items
    if isinstance(template, torch.Tensor) and isinstance(saved, (int, float)) and not isinstance(saved, bool):
        return torch.tensor(saved, dtype=template.dtype)
    return saved
