"""Hiding credentials in what the product prints: one helper for every URL and message.

Database URLs, MLflow tracking URIs (http://user:password@host, postgresql://user:password@...)
and the error texts of their clients can carry a password. Everything specdec prints, logs, tags
or stores about a URL goes through mask_url (one URL) or mask_text (free text that may hold URLs).

The password is found by parsing, not by a pattern: `urllib.parse.urlsplit` takes the userinfo as
everything before the netloc's last "@" and the password as what follows its first ":", so every
character RFC 3986 allows there (unreserved, sub-delims such as ' ! $ & ( ) * + , ; =, percent
escapes, and ":" itself) is hidden, and so is an unescaped "@" that a client would read as part of
the password. (SQLAlchemy's make_url reads the password only up to the first "@", so its
hide_password rendering would show the rest; urlsplit hides the superset.) In free text, each
run of non-blank characters that starts with `scheme://` is a URL candidate and is parsed the same
way; characters after the URL (a closing quote, a bracket) stay as they are.
"""

from __future__ import annotations

import re
from urllib.parse import unquote, urlsplit

MASK = "***"
# query parameters that name a secret: ?password=... &token=...
SECRET_QUERY_KEYS = frozenset({"password", "passwd", "pwd", "token", "access_token", "api_key",
                               "apikey", "secret"})
# where a URL may start in free text: a scheme (RFC 3986 3.1) and "//", up to the next blank
_URL_CANDIDATE = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*://\S*")


def _mask_query(query: str) -> str:
    """The query with the value of every secret parameter replaced (the other parameters kept
    byte for byte). Parameters are separated by "&" alone, as urllib.parse.parse_qsl reads them."""
    parts = query.split("&")
    for i, part in enumerate(parts):
        key, sep, value = part.partition("=")
        if sep and value and unquote(key).lower() in SECRET_QUERY_KEYS:
            parts[i] = f"{key}={MASK}"
    return "&".join(parts)


def mask_url(url: str | None) -> str:
    """One URL, its password and secret query parameters replaced by ***; a URL without any (or
    a string that is no URL) is returned as it is."""
    url = url or ""
    try:
        parts = urlsplit(url)
    except ValueError:      # e.g. an unbalanced "[" in the host: hide the whole authority
        head, sep, rest = url.partition("://")
        return f"{head}{sep}{MASK}" if sep and "@" in rest else url
    masked = url
    netloc = parts.netloc
    if parts.password:
        start = url.find("//") + 2
        userinfo, _, hostport = netloc.rpartition("@")
        if url[start:start + len(netloc)] != netloc:     # urlsplit dropped a tab or newline
            return f"{url[:start]}{MASK}@{hostport}"
        user = userinfo.partition(":")[0]
        masked = f"{url[:start]}{user}:{MASK}@{hostport}{url[start + len(netloc):]}"
    if parts.query:
        query = _mask_query(parts.query)
        if query != parts.query:
            # the query is what lies between the first "?" after the authority and the fragment
            head, sep, tail = masked.partition("?")
            masked = head + sep + query + tail[len(parts.query):]
    return masked


def mask_text(text: str) -> str:
    """`text` with the password and secret query parameters of every URL in it replaced by ***."""
    if not text:
        return text
    return _URL_CANDIDATE.sub(lambda m: mask_url(m.group(0)), text)


# Characters a terminal acts on instead of showing: C0 controls (ESC starts colour, cursor and
# title sequences), DEL, C1 controls, and the bidirectional overrides and isolates that reorder
# what is shown (a right-to-left override hides what follows)
_UNPRINTABLE = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def printable(text: str, keep_newlines: bool = False) -> str:
    """`text` as a terminal shows it as it is: every control character, escape sequence and
    bidirectional override written as its Python escape (ESC as \\x1b, U+202E as \\u202e, a
    newline as \\n), everything else unchanged. For what we quote of outside input (a server's
    body, a name given to us) in a message. keep_newlines: newlines (not carriage returns) kept,
    for a message of our own that has several lines."""
    if not text:
        return text

    def shown(match: re.Match) -> str:
        character = match.group(0)
        if keep_newlines and character == "\n":
            return character
        return character.encode("unicode_escape").decode("ascii")

    return _UNPRINTABLE.sub(shown, text)
