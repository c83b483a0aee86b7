"""Hiding credentials in what the product prints: one helper for every URL and message.

Database URLs, MLflow tracking URIs (http://user:password@host, postgresql://user:password@...)
and the error texts of their clients can carry a password. Everything specdec prints, logs, tags
or stores about a URL goes through mask_url (one URL) or mask_text (free text that may hold URLs).
"""

from __future__ import annotations

import re

MASK = "***"
# scheme://user:password@  -> scheme://user:***@
_USERINFO = re.compile(r"(?P<head>[A-Za-z][A-Za-z0-9+.\-]*://[^:/?#@\s'\"]*):(?P<secret>[^@\s'\"]*)@")
# ?password=... &token=... (query parameters that name a secret)
_QUERY = re.compile(r"(?P<head>[?&;](?:password|passwd|pwd|token|access_token|api_key|apikey|secret)=)"
                    r"(?P<secret>[^&;\s'\"]+)", re.IGNORECASE)


def mask_text(text: str) -> str:
    """`text` with the password of every URL in it, and secret query parameters, replaced by ***."""
    if not text:
        return text
    text = _USERINFO.sub(lambda m: f"{m.group('head')}:{MASK}@" if m.group("secret") else m.group(0), text)
    return _QUERY.sub(lambda m: m.group("head") + MASK, text)


def mask_url(url: str | None) -> str:
    """One URL, credentials hidden (a URL without any is returned as it is)."""
    return mask_text(url or "")
