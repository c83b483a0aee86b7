"""Identifiers that become paths (run ids, draft ids, profile names) and the paths built from them
under $SPECDEC_HOME.

- check_identifier: the one rule for an identifier given at a boundary (the CLI, a step's entry):
  1 to IDENTIFIER_MAX_CHARS characters from IDENTIFIER_CHARS (letters, digits and _ . ~ : + -, the
  characters of Airflow's run ids), starting with a letter, digit or underscore. So no path
  separator, no "." or ".." segment, no blank, control or bidi-override character.
- home_path: $SPECDEC_HOME/part/part/...; refuses any part that is not one plain path component
  (empty, ".", "..", a separator, NUL), so the path cannot leave the home whatever a part holds.
  The check is on the path as written: a symlink the operator put inside the home is followed.
"""

from __future__ import annotations

import re
from pathlib import Path

from .errors import InvalidIdentifier
from .settings import specdec_home

IDENTIFIER_MAX_CHARS = 200
IDENTIFIER_CHARS = "letters, digits and _ . ~ : + -"
_IDENTIFIER = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.~:+\-]*")
_SHOWN_CHARS = 60      # how much of a refused input the error shows


def shown(value) -> str:
    """A refused input as an error shows it: repr (control and bidi characters escaped), the
    first _SHOWN_CHARS characters of a long one and its length."""
    if not isinstance(value, str):
        return f"{value!r} ({type(value).__name__})"
    if len(value) <= _SHOWN_CHARS:
        return repr(value)
    return f"{value[:_SHOWN_CHARS]!r}... ({len(value):,} characters)"


def check_identifier(value, what: str = "run id", why: str = "it names files under $SPECDEC_HOME") -> str:
    """`value` when it is a valid identifier, else InvalidIdentifier naming it and the rule."""
    if isinstance(value, str) and len(value) <= IDENTIFIER_MAX_CHARS and _IDENTIFIER.fullmatch(value):
        return value
    raise InvalidIdentifier(
        f"{what} {shown(value)} is not allowed: use 1 to {IDENTIFIER_MAX_CHARS} of {IDENTIFIER_CHARS}, "
        f"starting with a letter, digit or _ ({why})")


def home_path(*parts: str) -> Path:
    """specdec_home() / parts, each part one plain path component; InvalidIdentifier otherwise."""
    for part in parts:
        if (not isinstance(part, str) or part in ("", ".", "..") or "/" in part or "\\" in part
                or "\x00" in part):
            raise InvalidIdentifier(
                f"path component {shown(part)} would leave its folder under $SPECDEC_HOME "
                f"({specdec_home()}); give a name without / or \\ that is not . or ..")
    return specdec_home().joinpath(*parts)
