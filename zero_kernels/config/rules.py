"""The machinery behind the config schema: value rules, sections, and one parse pass.

A *rule* checks and normalises one JSON value (``Scalar``) or a nested object (``Section``). A
section's schema is a table ``key -> Field``; keys that DeepSpeed accepts but that change nothing
here sit in a second table ``key -> logging level``. ``parse_section`` walks one object against
its tables, resolves Hugging Face style ``"auto"`` values, and records what it ignored and chose
in a ``ParseContext`` that logs both once at the end.

Every rejection is a ``ValueError`` naming the full key path, the value and what is allowed.
"""

from __future__ import annotations

import difflib
import logging
import math
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, is_dataclass
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

logger = logging.getLogger("zero_kernels")

AUTO = "auto"
MISSING = object()


class Invalid(Exception):
    """Raised by a converter when a value is outside its rule; ``Scalar`` turns it into ValueError."""


def join(path: str, key: str) -> str:
    """``zero_optimization`` + ``stage`` -> ``zero_optimization.stage`` (no leading dot at top level)."""
    return f"{path}.{key}" if path else key


def suggest(key: str, known: Any) -> str:
    """A ``; did you mean 'x'?`` hint for a misspelt key, or an empty string."""
    close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


@dataclass(frozen=True)
class Scalar:
    """One JSON value: ``convert`` normalises it or raises ``Invalid``; ``allowed`` says what passes.

    ``supported`` (optional) narrows the accepted values to those implemented so far: others are
    valid DeepSpeed but rejected here with a "not supported yet" message.
    """

    allowed: str
    convert: Callable[[Any], Any]
    supported: Optional[Tuple[Any, ...]] = None

    def __call__(self, value: Any, path: str, ctx: Optional[ParseContext] = None) -> Any:
        try:
            result = self.convert(value)
        except Invalid:
            raise ValueError(f"{path}={value!r} is invalid: expected {self.allowed}") from None
        if self.supported is not None and result not in self.supported:
            allowed = ", ".join(repr(v) for v in self.supported)
            raise ValueError(f"{path}={value!r} is not supported yet by zero_kernels; supported: {allowed}")
        return result


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _range_text(lo: Optional[float], hi: Optional[float], hi_open: bool) -> str:
    parts = []
    if lo is not None:
        parts.append(f">= {lo:g}")
    if hi is not None:
        parts.append(f"{'<' if hi_open else '<='} {hi:g}")
    return " and ".join(parts)


def _in_range(x: float, lo: Optional[float], hi: Optional[float], hi_open: bool) -> bool:
    if lo is not None and x < lo:
        return False
    return hi is None or (x < hi if hi_open else x <= hi)


_INTEGER_TEXT = re.compile(r"\s*[+-]?\d+(\.0*)?\s*")


def integer(lo: Optional[int] = None, hi: Optional[int] = None, *, multiple_of: int = 1, text: bool = False) -> Scalar:
    """An int (an integral float such as JSON's ``5e8`` counts; ``2.5`` and booleans do not), a multiple of
    ``multiple_of``; ``text``: a string holding one counts too (``"2"``, ``"2.0"``: DeepSpeed's config model
    reads its fp16 integers so)."""

    def convert(value: Any) -> int:
        if text and isinstance(value, str) and _INTEGER_TEXT.fullmatch(value):
            value = float(value)
        if not _is_number(value) or not math.isfinite(value) or value != int(value):
            raise Invalid
        if not _in_range(value, lo, hi, False) or int(value) % multiple_of:
            raise Invalid
        return int(value)

    bounds = f"from {lo} to {hi}" if lo is not None and hi is not None else _range_text(lo, hi, False)
    multiple = f", a multiple of {multiple_of}" if multiple_of != 1 else ""
    allowed = f"an integer {bounds}".strip() + multiple
    return Scalar(f"{allowed}, or a string holding one" if text else allowed, convert)


def enum_integer(lo: int, hi: int) -> Scalar:
    """An integer from ``lo`` to ``hi`` read as DeepSpeed's config model reads an integer enum (the stage):
    an int, an integral float (``2.0``) or a string holding one (``"2"``, ``"2.0"``). Booleans are
    refused (DeepSpeed would read ``true`` as 1)."""

    def convert(value: Any) -> int:
        if isinstance(value, str) and _INTEGER_TEXT.fullmatch(value):
            value = float(value)
        if not _is_number(value) or not math.isfinite(value) or value != int(value) or not lo <= value <= hi:
            raise Invalid
        return int(value)

    return Scalar(f'an integer from {lo} to {hi}, or a string holding one ("{hi}", "{hi}.0")', convert)


def number(
    lo: Optional[float] = None,
    hi: Optional[float] = None,
    *,
    hi_open: bool = False,
    text: bool = False,
) -> Scalar:
    """A finite int or float (not a boolean), returned as float; ``text``: a string holding one counts too
    (read by ``float``, as DeepSpeed reads ``fp16.loss_scale``)."""

    def convert(value: Any) -> float:
        if text and isinstance(value, str):
            try:
                value = float(value)
            except ValueError:
                raise Invalid from None
        if not _is_number(value) or not math.isfinite(value):
            raise Invalid
        if not _in_range(value, lo, hi, hi_open):
            raise Invalid
        return float(value)

    allowed = f"a finite number {_range_text(lo, hi, hi_open)}".strip()
    return Scalar(f"{allowed}, or a string holding one" if text else allowed, convert)


def boolean(supported: Optional[Tuple[bool, ...]] = None, *, nullable: bool = False) -> Scalar:
    """JSON ``true`` or ``false`` only (not 0/1, not strings); null too if ``nullable``."""

    def convert(value: Any) -> Optional[bool]:
        if value is None and nullable:
            return None
        if not isinstance(value, bool):
            raise Invalid
        return value

    return Scalar("true, false or null" if nullable else "true or false", convert, supported)


def choice(
    names: Mapping[str, Any],
    *,
    nullable: bool = False,
    shown: Optional[Tuple[str, ...]] = None,
) -> Scalar:
    """A case-insensitive name from ``names`` (lower-case name -> stored value); null if ``nullable``.

    ``shown``: the spellings listed in messages (default: the keys of ``names``).
    """
    listed = ", ".join(repr(n) for n in (shown or tuple(names))) + (", null" if nullable else "")

    def convert(value: Any) -> Any:
        if value is None and nullable:
            return None
        if not isinstance(value, str) or value.lower() not in names:
            raise Invalid
        return names[value.lower()]

    return Scalar(f"one of {listed} (case-insensitive)", convert)


def pair(item: Scalar) -> Scalar:
    """A list or tuple of exactly two values, each passing ``item``; returned as a tuple."""

    def convert(value: Any) -> Tuple[Any, Any]:
        if not isinstance(value, (list, tuple)) or len(value) != 2:
            raise Invalid
        return tuple(item.convert(v) for v in value)

    return Scalar(f"a pair [x, y], each {item.allowed}", convert)


def text(*, nullable: bool = False) -> Scalar:
    """A JSON string (any, the empty one too); null if ``nullable``."""

    def convert(value: Any) -> Optional[str]:
        if value is None and nullable:
            return None
        if not isinstance(value, str):
            raise Invalid
        return value

    return Scalar("a string" + (" or null" if nullable else ""), convert)


def names() -> Scalar:
    """A JSON list of strings (possibly empty), returned as a tuple."""

    def convert(value: Any) -> Tuple[str, ...]:
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise Invalid
        return tuple(value)

    return Scalar("a list of strings", convert)


def strings() -> Scalar:
    """A JSON string or list of strings, returned as a tuple (a string alone: a tuple of one)."""

    def convert(value: Any) -> Tuple[str, ...]:
        value = [value] if isinstance(value, str) else value
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
            raise Invalid
        return tuple(dict.fromkeys(value))

    return Scalar("a string or a list of strings", convert)


def rejected(instead: str) -> Scalar:
    """A key DeepSpeed refuses too; the message names what to write ``instead``."""

    def convert(value: Any) -> Any:
        raise Invalid

    return Scalar(f"{instead} instead (DeepSpeed refuses this key too)", convert)


@dataclass(frozen=True)
class Unsupported:
    """A key that DeepSpeed, or a tool that hands DeepSpeed its config, acts on and zero_kernels cannot honour.

    Refused with ``what`` it would change unless ``off(value)`` says it is turned off (then it changes
    nothing: logged at INFO); ``how_off`` says how to turn it off.
    """

    what: str
    off: Callable[[Any], bool]
    how_off: str

    def check(self, value: Any, path: str, ctx: ParseContext) -> None:
        if not self.off(value):
            raise ValueError(f"{path}={value!r} is not supported by zero_kernels: {self.what}; {self.how_off}")
        ctx.ignore(path, logging.INFO)


@dataclass(frozen=True)
class Unused:
    """A key DeepSpeed accepts and zero_kernels does not act on (logging, monitoring): its value is checked by
    ``rule`` as DeepSpeed types it, then the key is logged with the ignored ones, at ``level`` or, where
    ``quiet(value)`` says it turns nothing on, at INFO. ``rule`` None: DeepSpeed reads no value of it."""

    rule: Any
    level: int = logging.WARNING
    quiet: Callable[[Any], bool] = lambda value: False

    def check(self, value: Any, path: str, ctx: ParseContext) -> None:
        if self.rule is not None and value != AUTO:
            self.rule(value, path, ctx)
        ctx.ignore(path, logging.INFO if self.quiet(value) else self.level)


@dataclass(frozen=True)
class Field:
    """One key of a section: its rule, its default and whether ``"auto"`` may stand for it."""

    rule: Any
    default: Any = None
    auto: bool = True


@dataclass(frozen=True)
class Section:
    """A nested JSON object parsed against its own tables.

    ``ignored`` maps keys accepted without effect to the level they are logged at; ``aliases`` maps
    alternative names to canonical keys; ``finish`` turns the parsed dict into the stored value;
    ``optional``: a missing or ``null`` section is ``None`` rather than all defaults; ``nullable``: an explicit
    ``null`` means all defaults; ``shorthand``: the key a bare string stands for (``"none"`` is
    read as ``{shorthand: "none"}``); ``unsupported``: keys refused with what they would change, unless off;
    ``unused``: keys accepted without effect whose values are checked (``Unused``); ``replaced``: deprecated
    boolean keys that stand, when true, for another key's block, refused given true together with that key;
    ``inert``: keys kept as parsed values that act on nothing here, logged with the ignored ones when given, at INFO
    where ``inert[key](value, values)`` says zero_kernels does what the value asks anyway, else at WARNING.
    """

    fields: Mapping[str, Field]
    ignored: Mapping[str, int] = field(default_factory=dict)
    unsupported: Mapping[str, Unsupported] = field(default_factory=dict)
    unused: Mapping[str, Unused] = field(default_factory=dict)
    aliases: Mapping[str, str] = field(default_factory=dict)
    replaced: Mapping[str, str] = field(default_factory=dict)
    inert: Mapping[str, Callable[[Any, Mapping[str, Any]], bool]] = field(default_factory=dict)
    finish: Callable[[Dict[str, Any]], Any] = dict
    optional: bool = False
    nullable: bool = False
    shorthand: Optional[str] = None
    allowed: str = "a JSON object"

    def __call__(self, value: Any, path: str, ctx: Optional[ParseContext] = None) -> Any:
        if value is None and self.optional:
            return None
        if value is None and self.nullable:
            value = {}
        elif isinstance(value, str) and self.shorthand is not None:
            value = {self.shorthand: value}
        elif is_dataclass(value) and not isinstance(value, type):
            # A parsed block given back (``ZeroOptions`` fields as keywords): its keys without effect were logged
            # when it was parsed, and its dataclass holds them at their defaults.
            value = {key: v for key, v in asdict(value).items() if key not in self.unused}
        if not isinstance(value, Mapping):
            raise ValueError(f"{path}={value!r} is invalid: expected {self.allowed}")
        return self.finish(parse_section(value, path, self, ctx if ctx is not None else ParseContext()))


@dataclass(frozen=True)
class Override:
    """A value given for one key path (by keyword, or from Hugging Face ``TrainingArguments``).

    ``strict``: a different explicit value is an error. ``fills_missing``: a strict override also
    sets a key the config leaves out (keywords do; ``TrainingArguments``, like the Trainer, fill
    only ``"auto"``). ``shown``: how that error names the source and its value, where the value is
    derived from the source's own (default ``source=value``).
    """

    value: Any
    source: str
    strict: bool = True
    fills_missing: bool = True
    shown: Optional[str] = None

    def describe(self) -> str:
        return self.shown if self.shown is not None else f"{self.source}={self.value!r}"


@dataclass
class ParseContext:
    """What one parse was given by keyword and what it ignored and chose, logged once by ``log``."""

    overrides: Dict[str, Override] = field(default_factory=dict)
    # Values for "auto" when no override gives one: key path -> (value, or a function of this
    # context returning it, and the source logged with it).
    auto_defaults: Dict[str, Tuple[Any, str]] = field(default_factory=dict)
    used: Set[str] = field(default_factory=set)
    ignored: Dict[int, List[str]] = field(default_factory=dict)
    chosen: List[str] = field(default_factory=list)
    resolved: List[str] = field(default_factory=list)
    values: Dict[str, Any] = field(default_factory=dict)
    autos: Set[str] = field(default_factory=set)
    derived: Set[str] = field(default_factory=set)  # "auto" paths whose value is derived (and logged) later

    def ignore(self, path: str, level: int) -> None:
        self.ignored.setdefault(level, []).append(path)

    def choose(self, path: str, value: Any, why: str, *, auto: bool = False) -> None:
        """Record a value zero_kernels chose; ``auto``: it stands for an ``"auto"`` of the config."""
        (self.resolved if auto else self.chosen).append(f"{path}={value!r} ({why})")

    def log(self) -> None:
        """One record per level for ignored keys, one for derived values (INFO), one for "auto" values (WARNING)."""
        for level in sorted(self.ignored):
            keys = ", ".join(sorted(self.ignored[level]))
            logger.log(level, "DeepSpeed config keys accepted but without effect in zero_kernels: %s", keys)
        if self.chosen:
            logger.info("DeepSpeed config values chosen by zero_kernels: %s", ", ".join(self.chosen))
        if self.resolved:
            logger.warning('DeepSpeed config "auto" values resolved by zero_kernels: %s', ", ".join(self.resolved))


def _resolve(spec: Field, raw: Any, path: str, ctx: ParseContext) -> Tuple[Any, str]:
    """The value to validate for ``path`` (a keyword override, a default for "auto", ``raw`` or
    MISSING) and the name to report it under."""
    override = ctx.overrides.get(path)
    if raw == AUTO:
        ctx.autos.add(path)
    if override is not None:
        ctx.used.add(path)
        where = f"{path} (from {override.source})"
        if raw == AUTO or (raw is MISSING and override.strict and override.fills_missing):
            ctx.choose(path, override.value, f"from {override.source}", auto=raw == AUTO)
            return override.value, where
        if raw is not MISSING and override.strict and spec.rule(raw, path) != spec.rule(override.value, where):
            raise ValueError(
                f"{path}={raw!r} in the config disagrees with {override.describe()}; "
                f'set {path} to "auto" or drop one of the two'
            )
    if raw == AUTO:
        if not spec.auto:
            raise ValueError(f'{path}="auto" is not allowed here: write {spec.rule.allowed}')
        if path in ctx.auto_defaults:
            value, why = ctx.auto_defaults[path]
            value = value(ctx) if callable(value) else value
        else:
            value, why = spec.default, "DeepSpeed's default"
        if value is not None or path not in ctx.derived:
            ctx.choose(path, value, why, auto=True)
        return value, path
    return raw, path


def _missing(spec: Field, path: str, ctx: ParseContext) -> Any:
    """The value of a key the config leaves out: its default, or a whole section of defaults."""
    if isinstance(spec.rule, Section):
        return None if spec.rule.optional else spec.rule({}, path, ctx)
    return spec.default


def _collect(d: Mapping, path: str, section: Section, ctx: ParseContext) -> Dict[str, Any]:
    """Canonical key -> raw value; unknown keys rejected, ignored keys recorded."""
    tables = (section.fields, section.aliases, section.ignored, section.unsupported, section.unused)
    known = list(dict.fromkeys(key for table in tables for key in table))  # every key the section accepts, in order
    raw: Dict[str, Any] = {}
    spelt: Dict[str, str] = {}  # canonical key -> the spelling given
    for key, value in d.items():
        if not path and isinstance(key, str) and key.startswith("_") and key not in known:
            ctx.ignore(key, logging.INFO)  # a comment ("_comment"): DeepSpeed ignores unknown top-level keys
            continue
        if not isinstance(key, str) or key not in known:
            where = f"in {path}" if path else "at the top level of the config"
            hint = suggest(str(key), known) or f"; expected one of {', '.join(repr(k) for k in known)}"
            raise ValueError(f"unknown key {key!r} {where}{hint}")
        if key in section.unsupported:
            section.unsupported[key].check(value, join(path, key), ctx)
            continue
        if key in section.unused:
            section.unused[key].check(value, join(path, key), ctx)
            continue
        if key in section.ignored:
            ctx.ignore(join(path, key), section.ignored[key])
            continue
        canonical = section.aliases.get(key, key)
        if canonical in raw:
            raise ValueError(
                f"{join(path, canonical)} is given twice, as {spelt[canonical]!r} and as {key!r}: keep one"
            )
        raw[canonical], spelt[canonical] = value, key
    _check_replaced(raw, path, section)
    return raw


def _check_replaced(raw: Mapping[str, Any], path: str, section: Section) -> None:
    """A deprecated key set true beside the key that replaced it (which would win, or be overridden) is refused,
    as DeepSpeed refuses the two together."""
    for old, new in section.replaced.items():
        if raw.get(old) is True and new in raw:
            raise ValueError(
                f"{join(path, old)}=true and {join(path, new)}={raw[new]!r} are given together: {old} is "
                f"DeepSpeed's deprecated spelling of {new} with device 'cpu' (DeepSpeed refuses the two together); "
                f"keep only {new}"
            )


def parse_section(d: Mapping, path: str, section: Section, ctx: ParseContext) -> Dict[str, Any]:
    """Validate ``d`` against ``section``: canonical key -> normalised value, defaults filled in.

    A value whose default is ``None`` may also be written as ``null`` or ``"auto"`` and stays ``None``;
    a nested section may be ``null`` only where it says ``nullable``.
    """
    raw = _collect(d, path, section, ctx)
    out: Dict[str, Any] = {}
    for key, spec in section.fields.items():
        sub = join(path, key)
        value, where = _resolve(spec, raw.get(key, MISSING), sub, ctx)
        if value is MISSING:
            out[key] = _missing(spec, sub, ctx)
        elif value is None and spec.default is None and not isinstance(spec.rule, Section):
            out[key] = None
        else:
            out[key] = spec.rule(value, where, ctx)
        ctx.values[sub] = out[key]
    for key, done_anyway in section.inert.items():
        if key in raw:
            ctx.ignore(join(path, key), logging.INFO if done_anyway(out[key], out) else logging.WARNING)
    return out
