"""Checks of the Python API's arguments, so that every entry point refuses a wrong type or value with the
same one-line UserError (the CLI prints it and exits 2) rather than failing later inside torch."""
from __future__ import annotations

import math
import numbers

from workbench.errors import UserError
from workbench.files import short_repr


def name_list(text: str | list[str], option: str, what: str = "") -> list[str]:
    """A comma-separated option's names ('a, b' -> ['a', 'b']; a list of names is taken as given), each
    stripped; UserError for an empty item (a doubled or trailing comma, or nothing at all): refused, not
    dropped, so that a typo never runs another plan than the one written. what: the noun for one name."""
    items = [s.strip() for s in (text.split(",") if isinstance(text, str) else text)]
    names = f"{what} names" if what else "names"
    if not any(items):   # nothing at all: an empty list, or only commas and spaces
        raise UserError(f"{option} is empty: give {names} separated by commas")
    if not all(items):
        shown = text if isinstance(text, str) else ",".join(text)
        raise UserError(f"{option} {shown!r} has an empty item: give {names} separated by single commas")
    return items


def require_bool(name: str, value) -> None:
    """`value` is True or False (not 0, 1 or a string)."""
    if not isinstance(value, bool):
        raise UserError(f"{name} must be True or False, got {short_repr(value)}")


def require_count(name: str, value, optional: bool = False) -> None:
    """`value` is an int >= 1 (a bool is not), or with `optional` None."""
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UserError(f"{name} must be an integer >= 1{' or None' if optional else ''}, got {short_repr(value)}")


def require_positive(name: str, value, optional: bool = False) -> None:
    """`value` is a finite real number > 0 (an int, a float or a numpy scalar; a bool is not), or with
    `optional` None."""
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not (math.isfinite(value) and value > 0):
        raise UserError(f"{name} must be a number > 0{' or None' if optional else ''}, got {short_repr(value)}")
