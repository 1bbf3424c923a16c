"""Warehouse URLs safe to show: every secret in them replaced by `***`.

`redact_url` is the one way a URL is printed, logged or stored by ettflow; `has_password`
says whether a URL carries a secret (then it must come from the environment or a Prefect
`Secret` block, never from a flow parameter).

A URL carries a secret in two places: its userinfo (`//user:secret@host`) and its query, which
SQLAlchemy hands to the driver as connection arguments (`?password=secret`: psycopg and libpq
take the password from there as well; `sslpassword` unlocks a client key). Both are judged
and hidden. A URL SQLAlchemy cannot parse is judged by its text, with SQLAlchemy's own rule for
the userinfo (a password runs to the first `@`, `/` included).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING
from urllib.parse import quote, quote_plus

if TYPE_CHECKING:
    from sqlalchemy.engine import URL

# query keys whose value is a secret the driver uses (psycopg/libpq, pymysql, pyodbc spellings)
SECRET_QUERY_KEYS = frozenset({"password", "passwd", "pwd", "sslpassword"})
_USER = r"//[^/@:]*"  # a URL's '//user' (SQLAlchemy's rule: the password after it runs to the first '@')
_USERINFO = re.compile(rf"({_USER}):([^@]*)@")  # '//user:secret@' in a URL SQLAlchemy cannot parse
_QUERY = re.compile(rf"([?&](?:{'|'.join(sorted(SECRET_QUERY_KEYS))})=)([^&#]*)", re.IGNORECASE)
# the same rule as JSON Schema, what a URL parameter must `not` match (Prefect's server checks it
# before it stores a run's parameters): JSON Schema patterns take no flags, so a class per letter
SECRET_URL_PATTERN = rf"{_USER}:[^@]*@|[?&](" + "|".join(
    "".join(f"[{c}{c.upper()}]" for c in key) for key in sorted(SECRET_QUERY_KEYS)) + ")="
_HIDDEN = "ettflowhiddensecret"  # rendered, then shown as `***` (SQLAlchemy would escape the stars)


def redact_url(url: str | URL) -> str:
    """`url` with its password and secret query values shown as `***` (SQLAlchemy's own
    rendering where it parses)."""
    parsed = _parsed(url)
    if parsed is None:
        return _QUERY.sub(r"\1***", _USERINFO.sub(r"\1:***@", str(url)))
    secret = _secret_keys(parsed)
    if secret:
        parsed = parsed.update_query_dict({k: _HIDDEN for k in secret})
    return parsed.render_as_string(hide_password=True).replace(_HIDDEN, "***")


def has_password(url: str | URL) -> bool:
    """Whether `url` holds a password or another secret (an unparseable URL is judged by its text)."""
    parsed = _parsed(url)
    if parsed is None:
        return bool(_USERINFO.search(str(url)) or _QUERY.search(str(url)))
    return parsed.password is not None or bool(_secret_keys(parsed))


def redact_argv(argv: list[str]) -> list[str]:
    """A command's arguments with every URL that holds a secret redacted (`--url X`, `--url=X`)."""
    out = []
    for arg in argv:
        flag, eq, value = arg.partition("=") if arg.startswith("--") else ("", "", arg)
        out.append(f"{flag}{eq}{redact_url(value)}" if "://" in value and has_password(value) else arg)
    return out


def scrub(text: str, url: str | URL) -> str:
    """`text` (a driver's error message, a log line) with every secret `url` holds shown as `***`,
    as written and percent-encoded: for text that may quote the URL or its parts."""
    for secret in sorted(_secrets(url), key=len, reverse=True):
        for form in {secret, quote(secret, safe=""), quote_plus(secret, safe="")}:
            text = text.replace(form, "***")
    return text


# any URL's '//user:secret@' or secret query value inside free text (a driver's message), when the
# URL is not known: the secret ends at white space, so a passwordless URL and a later '@' in the
# sentence are not taken for one
_TEXT_USERINFO = re.compile(r"(//[^/@:\s]*):([^@\s]+)@")
_TEXT_QUERY = re.compile(rf"([?&](?:{'|'.join(sorted(SECRET_QUERY_KEYS))})=)([^&#\s]+)", re.IGNORECASE)


def scrub_urls(text: str) -> str:
    """`text` with the secret of every URL in it shown as `***` (its userinfo password, a secret
    query value), whatever URL it is: the fallback where the warehouse's own URL is unknown."""
    return _TEXT_QUERY.sub(r"\1***", _TEXT_USERINFO.sub(r"\1:***@", text))


def _parsed(url: str | URL) -> URL | None:
    """SQLAlchemy's reading of `url`, None where it cannot parse it (imported here: the flow's
    parameters import this module's names, and most of them never open a warehouse)."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        return make_url(url)
    except (ArgumentError, ValueError, TypeError):
        return None


def _secret_keys(url: URL) -> list[str]:
    return [k for k in url.query if k.lower() in SECRET_QUERY_KEYS]


def _secrets(url: str | URL) -> set[str]:
    parsed = _parsed(url)
    if parsed is None:
        text = str(url)
        return {m.group(2) for pattern in (_USERINFO, _QUERY) for m in pattern.finditer(text) if m.group(2)}
    values = [parsed.password] if parsed.password else []
    for key in _secret_keys(parsed):
        value = parsed.query[key]
        values += [value] if isinstance(value, str) else list(value)
    return {str(v) for v in values if v}
