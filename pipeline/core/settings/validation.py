"""How settings are checked: the pydantic configuration every section shares, and pydantic's validation errors
turned into one `ParamsError` line that names each dotted key (`train.lr: must be greater than 0 (got -1)`)."""

from __future__ import annotations

import dataclasses
import functools
import json
import re
from collections.abc import Callable, Mapping
from typing import Any, TypeVar, dataclass_transform

from pydantic import ConfigDict, Field, TypeAdapter, ValidationError
from pydantic.dataclasses import dataclass

from pipeline.core.errors import UserError

T = TypeVar("T")


class ParamsError(UserError, ValueError):
    """A params file or section that cannot be used as written."""


#: Every section's: unknown keys are errors (a typo never falls back to a default), a field's docstring is its
#: description in the JSON schema. Params files are also validated strictly (`validate`: "3" is not an int, 1 is not
#: `true`); sections built in code take pydantic's lax mode, so a numpy integer still counts as an int.
SECTION_CONFIG = ConfigDict(extra="forbid", use_attribute_docstrings=True)


@dataclass_transform(frozen_default=True, field_specifiers=(dataclasses.field, Field))
def settings_section(key: str) -> Callable[[type[T]], type[T]]:
    """The class as a frozen pydantic dataclass with `SECTION_CONFIG` for the params section `key` ("" for the
    root): validated whenever it is built, by `dataclasses.replace` too, failing with a `ParamsError` that names the
    dotted keys. It stays a dataclass, so `dataclasses.replace`/`asdict`/`fields` work on it."""

    def build(cls: type[T]) -> type[T]:
        model = dataclass(frozen=True, config=SECTION_CONFIG)(cls)
        init = model.__init__

        @functools.wraps(init)
        def checked_init(self: Any, *args: Any, **kwargs: Any) -> None:
            try:
                init(self, *args, **kwargs)
            except ValidationError as exc:
                raise ParamsError(describe(exc, model, key)) from None

        model.__init__ = checked_init  # type: ignore[method-assign]
        return model

    return build


#: Validation context key: the values are a whole params file, so the rules across sections apply too.
WHOLE_FILE = "whole_file"


def validate(cls: type[T], values: Mapping[str, Any], prefix: str = "") -> T:
    """`cls` built from plain YAML values, strictly, every rule checked. Strict validation takes them in JSON mode,
    where a mapping may stand for a nested section (Python mode would ask for instances); YAML 1.2's scalars are
    JSON's."""
    try:
        return TypeAdapter(cls).validate_json(json.dumps(values, default=str), strict=True,
                                              context={WHOLE_FILE: True})
    except ValidationError as exc:
        raise ParamsError(describe(exc, cls, prefix)) from None


def describe(exc: ValidationError, cls: type, prefix: str = "") -> str:
    """Every error of `exc` as `dotted.key: what is wrong (got value)`, joined on one line; the branches of a union
    (`bool | "auto"`) make one line for their key."""
    grouped: dict[str, list[Any]] = {}
    for err in exc.errors(include_url=False):
        grouped.setdefault(_key(cls, prefix, err["loc"]), []).append(err)
    return "; ".join(_line(key, errs, cls) for key, errs in grouped.items())


def _line(key: str, errs: list[Any], cls: type) -> str:
    first = errs[0]
    if first["type"] in ("extra_forbidden", "unexpected_keyword_argument"):
        parent = key.rpartition(".")[0]
        known = _fields(cls, [p for p in first["loc"][:-1] if isinstance(p, str)])
        where = f"key in '{parent}'" if parent else "section"
        return f"{key}: unknown {where} (known: {', '.join(known)})"
    if first["type"] == "value_error":
        msg = first["msg"].removeprefix("Value error, ")
        if re.match(r"^[\w.\[\]]+: ", msg):  # a rule naming its own key, relative to `key`
            return f"{key}.{msg}" if key else msg
        return f"{key}: {msg}" if key else msg
    if all(e["type"] == "literal_error" for e in errs):  # one closed set, maybe split over union branches
        allowed = ", ".join(e["ctx"]["expected"].replace(" or ", ", ") for e in errs)
        return f"{key}: must be one of {allowed} (got {first['input']!r})"
    wants = dict.fromkeys(e["msg"].removeprefix("Input should be ") for e in errs)
    return f"{key}: must be {' or '.join(wants)} (got {first['input']!r})"


def _key(cls: type, prefix: str, loc: tuple[Any, ...]) -> str:
    """The dotted key of an error location: section and field names, list indices; union branch tags dropped."""
    key = prefix
    current: type | None = cls
    for part in loc:
        if isinstance(part, int):
            key += f"[{part}]"
        elif current is not None:  # past a leaf field, a string is the tag of a union branch
            key = f"{key}.{part}" if key else str(part)
            current = _subsection(current, part)
    return key


def _fields(cls: type, path: list[str]) -> list[str]:
    """Field names of the section that `path` leads to from `cls` (empty where it leads nowhere)."""
    current: type | None = cls
    for part in path:
        current = _subsection(current, part) if current is not None else None
    return [f.name for f in dataclasses.fields(current)] if current is not None else []


def _subsection(cls: type, name: str) -> type | None:
    """The section class of field `name` of `cls` (None for a leaf or an unknown name)."""
    factory = next((f.default_factory for f in dataclasses.fields(cls) if f.name == name), None)
    return factory if isinstance(factory, type) and dataclasses.is_dataclass(factory) else None
