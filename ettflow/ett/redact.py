"""Warehouse URLs safe to show: the password replaced by `***`.

`redact_url` is the one way a URL is printed, logged or stored by ettflow; `has_password`
says whether a URL carries a secret (then it must come from the environment or a Prefect
`Secret` block, never from a flow parameter).
"""

from __future__ import annotations

import re

from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError

_USERINFO = re.compile(r"(//[^/@:]*):[^/@]*@")  # '//user:secret@' in a URL SQLAlchemy cannot parse


def redact_url(url: str | URL) -> str:
    """`url` with its password shown as `***` (SQLAlchemy's own rendering where it parses)."""
    try:
        return make_url(url).render_as_string(hide_password=True)
    except (ArgumentError, ValueError, TypeError):
        return _USERINFO.sub(r"\1:***@", str(url))


def has_password(url: str | URL) -> bool:
    """Whether `url` holds a password (an unparseable URL is judged by its text)."""
    try:
        return make_url(url).password is not None
    except (ArgumentError, ValueError, TypeError):
        return bool(_USERINFO.search(str(url)))
