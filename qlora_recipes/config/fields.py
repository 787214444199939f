"""A schema field's facts in its metadata, and the one walk that reads them.

`option(default, help, ...)` is `dataclasses.field` with the key's facts in `metadata` (as TRL's
SFTConfig does): `help`, and where they apply `choices` (the allowed values), `choices_hint` (what the
rejection adds), `positive` (must be > 0), `range` (a rule, see `range_ok`) and `resume_safe` (the key
may change between a run and its resumption). On a sub-config field `resume_safe` covers its keys.
`keys(schema)` walks every field; the checks (config/checks.py) and the resume comparison
(run/resume.py) derive their tables from it, so one key's facts live in one place.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from typing import Any


def option(
    default: Any,
    help: str,  # noqa: A002 - the metadata key TRL and HfArgumentParser use
    *,
    choices: tuple | None = None,
    choices_hint: str | None = None,
    positive: bool = False,
    range: str | None = None,  # noqa: A002
    resume_safe: bool = False,
) -> Any:
    """A dataclass field with its facts in metadata. A type as `default` (list, dict, a sub-config)
    is its default factory. A range rule: ">= N", "> N" or "[low, high)", with "|null" when null is
    allowed; the rejection names the rule and quotes `help`."""
    metadata: dict[str, Any] = {"help": help}
    if choices is not None:
        metadata["choices"] = tuple(choices)
    if choices_hint is not None:
        metadata["choices_hint"] = choices_hint
    if positive:
        metadata["positive"] = True
    if range is not None:
        metadata["range"] = range
    if resume_safe:
        metadata["resume_safe"] = True
    if isinstance(default, type):
        return dataclasses.field(default_factory=default, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def keys(schema: type, prefix: str = "") -> Iterator[tuple[str, dataclasses.Field]]:
    """(dotted key, field) for every field of `schema` and its sub-configs, in declaration order."""
    for f in dataclasses.fields(schema):
        yield prefix + f.name, f
        if is_section(f):
            yield from keys(f.type, f"{prefix}{f.name}.")


def values(cfg: Any, prefix: str = "") -> Iterator[tuple[str, dataclasses.Field, Any]]:
    """(dotted key, field, value) for every leaf of a typed config, in declaration order."""
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if is_section(f):
            yield from values(value, f"{prefix}{f.name}.")
        else:
            yield prefix + f.name, f, value


def is_section(f: dataclasses.Field) -> bool:
    """A field holding a sub-config (a group), not a value."""
    return isinstance(f.type, type) and dataclasses.is_dataclass(f.type)


def resume_safe_prefixes(schema: type, prefix: str = "") -> tuple[str, ...]:
    """Keys that may differ between a run and its resumption: "group." for a whole sub-config."""
    found: list[str] = []
    for f in dataclasses.fields(schema):
        if f.metadata.get("resume_safe"):
            found.append(prefix + f.name + ("." if is_section(f) else ""))
        elif is_section(f):
            found += resume_safe_prefixes(f.type, f"{prefix}{f.name}.")
    return tuple(found)


def range_ok(value: Any, rule: str) -> bool:
    """Whether `value` satisfies a range rule (see `option`): a finite number within it, or null
    where "|null" allows it."""
    bound, _, nullable = rule.partition("|")
    if value is None:
        return bool(nullable)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return False
    if bound.startswith("["):  # [low, high)
        low, high = (float(x) for x in bound[1:-1].split(","))
        return low <= value < high
    op, limit = bound.split()
    return value >= float(limit) if op == ">=" else value > float(limit)
