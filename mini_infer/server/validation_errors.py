"""Which of pydantic's validation errors a 400 reports, and where (chapter 11).

A request that fails validation can fail in several places at once, and a field of several forms
(a union: ``stop`` is a string or a list of them; a message's ``content`` is a string or a list of
parts) fails once per form. ``first_field_error`` picks the error to report: the first one, or,
for a value that has the type of exactly one form of its union, that form's error (17 stop
strings: "List should have at most 16 items", not "not a string"). Its location drops pydantic's
tags for the union's members, so that ``param`` names the field as the client wrote it.
``protocol.parse_request`` turns it into the 400.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

# Names pydantic adds to a location for the member of a union or a validator (not field names).
_TYPE_TAG = re.compile(
    r"[\[\(]|^(str|int|float|bool|list|dict|none|function-.*|literal.*|tagged-union.*)$", re.IGNORECASE
)

# Errors that only say a value is not of some type: in a union, every form it is not says so.
_TYPE_MISMATCH = frozenset(
    {"string_type", "int_type", "float_type", "bool_type", "list_type", "dict_type", "literal_error", "model_type"}
)


@dataclass(frozen=True)
class FieldError:
    """The error a 400 reports."""

    loc: list[str]  # the field's path as the client wrote it (union tags dropped)
    kind: str  # pydantic's error type: "missing", "extra_forbidden", "string_type", ...
    message: str  # pydantic's message, without its "Value error, " prefix

    @property
    def param(self) -> str | None:
        return ".".join(self.loc) or None


def first_field_error(exc: ValidationError) -> FieldError:
    errors = exc.errors(include_url=False)
    first = errors[0]
    closest = _closest_form(errors)
    if closest is not None:
        first, raw_loc = closest
    else:
        raw_loc = first["loc"]
    loc = [str(part) for part in raw_loc if isinstance(part, int) or not _TYPE_TAG.search(str(part))]
    message = str(first["msg"]).removeprefix("Value error, ")
    same_field = sum(1 for e in errors if [str(p) for p in e["loc"]][:1] == [str(p) for p in first["loc"]][:1])
    if closest is None and same_field > 1 and first["type"] in _TYPE_MISMATCH:
        message = f"invalid type or value ({message}, or one of the other accepted forms)"
    return FieldError(loc, first["type"], message)


def _closest_form(errors: list[Any]) -> tuple[Any, tuple[Any, ...]] | None:
    """For a field of several forms (a union) that its value fits none of: the first error of the
    one form whose type the value has, and that error's location without the form's tag (20 stop
    strings: the list is too long, not "not a string"; an image part: its type is not 'text').
    None when no form, or more than one, got past the type check (then no form is likelier)."""
    first = errors[0]
    if not first["loc"] or not _TYPE_TAG.search(str(first["loc"][-1])):
        return None  # not a union's form
    head = first["loc"][:-1]
    closest: dict[Any, Any] = {}
    for error in errors:
        loc = error["loc"]
        of_a_form = len(loc) > len(head) and loc[: len(head)] == head
        if of_a_form and (len(loc) > len(head) + 1 or error["type"] not in _TYPE_MISMATCH):
            closest.setdefault(loc[len(head)], error)  # keyed by the form's tag
    if len(closest) != 1:
        return None
    (error,) = closest.values()
    return error, (*head, *error["loc"][len(head) + 1 :])
