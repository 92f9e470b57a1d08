"""What of an environment variable may be shown: the one rule every ddpkit report uses.

A variable whose *name* looks secret is hidden whole: ``*** (N chars)`` (the length tells a
set value from an empty one, or a token with a stray newline, without a hash a short
password could be guessed back from). Any other value is shown with the credentials *inside*
it hidden (:func:`mask_text`): a URL's userinfo, ``user:password@host``, ``Authorization`` /
``Bearer`` values, ``key=value`` pairs whose key looks secret, JWTs, well-known token shapes
and PEM private keys. When in doubt, hidden: a false positive costs a bug report one value,
a false negative leaks a credential. No torch; every scan is linear in the value's length.

A name looks secret when one of its words (split at ``_ - .`` and camelCase) is one of
:data:`SECRET_WORDS`, or ends with one of :data:`SECRET_ENDINGS` (``PGPASSWORD``,
``ACCESSTOKEN``, ``APIKEY``), or is ``PWD`` in a name of several words (``MYSQL_PWD``; the
working directory's ``PWD`` alone is not secret). ``KEYBOARD``, ``TOKENIZERS_PARALLELISM``,
``AUTHOR`` or ``SLURM_SIGNAL`` are not; :data:`NOT_SECRET` lists the launcher and backend
settings the rule would catch although their values are settings, not credentials.

Every place ddpkit shows an environment or a value taken from one goes through this rule:
``ddpkit env`` and ``doctor`` (whole reports), ``plan`` (the spec), and the one-line errors
that quote a bad variable, flag or spec value (:func:`assignment`). ``submit --dry-run`` is
the exception: it prints the literal script that would be submitted.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

MASKED = "***"
SECRET_WORDS = frozenset(
    {
        "TOKEN", "TOKENS", "SECRET", "SECRETS", "PASS", "PASSWD", "PASSWORD", "PASSWORDS",
        "PASSPHRASE", "PW", "KEY", "KEYS", "JWT", "CREDENTIAL", "CREDENTIALS", "CRED",
        "CREDS", "AUTH", "OAUTH", "AUTHORIZATION", "AUTHN", "AUTHZ", "BEARER", "COOKIE",
        "COOKIES", "SESSION", "PRIVATE", "SIGNATURE", "SIG",
    }
)  # fmt: skip
SECRET_ENDINGS = ("TOKEN", "SECRET", "PASSWORD", "PASSWD", "PASSPHRASE", "KEY", "JWT", "COOKIE")
# Settings of SLURM, NCCL and torch whose names the rule catches: keys of a table, not secrets.
NOT_SECRET = frozenset(
    {
        "NCCL_IB_PKEY", "SLURM_WCKEY", "SLURM_PMI2_PPKEY", "SLURM_PMI_KVS_DUP_KEYS",
        "SLURM_PMI_KVS_NO_DUP_KEYS", "TORCH_COMPILE_STICKY_PGO_KEY",
        "TORCH_COMPILE_CACHE_KEY_TAG", "TORCH_DSA_KERNEL_ARGS_PASS",
    }
)  # fmt: skip

_WORDS = re.compile(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+|[0-9]+")
_SCHEME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789+.-")
_USER = re.compile(r"[^\s/?#@:]*")  # a user name as shown: no separator, no whitespace
_HOST_START = re.compile(r"[A-Za-z0-9\[]")
_BEARER = re.compile(r"(?i)\b(bearer)(\s+)[^\s,;\"']+")
# key=value, key: value, "key": "value" (JSON), ?key=value& (a query); the key is judged by
# secret_name, its value (read only then, so the scan stays linear) keeps an auth scheme word
# (Authorization: Bearer ***). A pair inside a value that is not hidden (a query inside a URL)
# is found all the same.
_PAIR = re.compile(r"(?P<key>[A-Za-z_][A-Za-z0-9_.-]{0,63})[\"']?\s*[=:]\s*[\"']?")
_VALUE = re.compile(r"(?P<scheme>(?i:bearer|basic|token|digest|negotiate)\s+)?[^\s&;,\"']*")
_SHAPES = re.compile(
    r"\beyJ[A-Za-z0-9_-]{4,}\.[A-Za-z0-9_-]{4,}\.[A-Za-z0-9_-]*"  # a JWT (SLURM_JWT's form)
    r"|\bgh[pousr]_[A-Za-z0-9]{20,}|\bgithub_pat_[A-Za-z0-9_]{20,}|\bglpat-[A-Za-z0-9_-]{20,}"
    r"|\bxox[abposr]-[A-Za-z0-9-]{10,}|\bhf_[A-Za-z0-9]{20,}|\bsk-[A-Za-z0-9_-]{20,}"
)
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def secret_name(name: str) -> bool:
    """Whether a variable (or a key inside a value) named ``name`` holds a secret."""
    if name.upper() in NOT_SECRET:
        return False
    words = [word.upper() for word in _WORDS.findall(name)]
    if len(words) > 1 and "PWD" in words:
        return True
    return any(word in SECRET_WORDS or word.endswith(SECRET_ENDINGS) for word in words)


def hidden(value: str) -> str:
    """A value hidden whole: ``*** (N chars)``."""
    return f"{MASKED} ({len(value)} char{'' if len(value) == 1 else 's'})"


def mask(name: str, value: str) -> str:
    """``value`` of the variable ``name`` as it may be shown (see the module doc)."""
    return hidden(value) if secret_name(name) else mask_text(value)


def assignment(name: str, value: str) -> str:
    """``NAME='value'`` as an error message quotes a variable or a flag (``--flag='value'``),
    the value shown by :func:`mask`: an error naming a bad value must not print a secret."""
    return f"{name}={mask(name.lstrip('-'), value)!r}"


def mask_text(text: str) -> str:
    """``text`` with every credential inside it hidden (see the module doc)."""
    if "PRIVATE KEY-----" in text.upper():
        return hidden(text)
    text = _mask_urls(text)
    text = "".join(_mask_bare(part) for part in re.split(r"(\s+)", text))
    text = _BEARER.sub(rf"\1\2{MASKED}", text)
    text = _mask_pairs(text)
    return _SHAPES.sub(MASKED, text)


def mask_tree(value: Any) -> Any:
    """``value`` (JSON-like: dicts, lists, strings, numbers) with :func:`mask_text` applied to
    every string in it (keys aside: they are the report's own field names)."""
    if isinstance(value, str):
        return mask_text(value)
    if isinstance(value, Mapping):
        return {key: mask_tree(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [mask_tree(item) for item in value]
    return value


def printable(text: str) -> str:
    """``text`` on one line of a terminal: control characters (newline, ESC...) escaped."""
    return _CONTROL.sub(lambda m: repr(m.group())[1:-1], text)


def _mask_urls(text: str) -> str:
    """Each ``scheme://`` URL's userinfo hidden: everything up to the *last* ``@`` before the
    next URL (a password may hold ``@``, ``/``, spaces; a token may be the user name)."""
    starts = [m.end() for m in re.finditer("://", text) if _has_scheme(text, m.start())]
    if not starts:
        return text
    out, done = [], 0
    for start, end in zip(starts, [*starts[1:], len(text)], strict=True):
        at = text.rfind("@", start, end)
        out.append(text[done:start])
        if at < 0:
            out.append(text[start:end])
        else:
            out.append(_userinfo(text[start:at]) + text[at:end])
        done = end
    return "".join(out) + text[done:]


def _has_scheme(text: str, colon: int) -> bool:
    """Whether ``://`` at ``colon`` follows a scheme (a letter, then letters, digits + . -)."""
    begin = colon
    while begin > 0 and colon - begin < 32 and text[begin - 1] in _SCHEME_CHARS:
        begin -= 1
    return begin < colon and text[begin].isalpha()


def _userinfo(userinfo: str) -> str:
    """``user:***`` when a plausible user name precedes a ``:``, else ``***`` (the user part
    alone may be the token: ``https://<token>@github.com``)."""
    user, colon, _ = userinfo.partition(":")
    if colon and _USER.fullmatch(user):
        return f"{user}:{MASKED}"
    return MASKED


def _mask_bare(token: str) -> str:
    """``user:password@host[:port]`` without a scheme: the password, up to the last ``@``."""
    at = token.rfind("@")
    colon = token.find(":")
    if "://" in token or at < 0 or not 0 <= colon < at or token[colon + 1 : colon + 3] == "//":
        return token
    if not _HOST_START.match(token, at + 1):
        return token
    return f"{token[:colon]}:{MASKED}{token[at:]}"


def _mask_pairs(text: str) -> str:
    """The value of each ``key=value`` pair whose key looks secret, hidden."""
    out, done = [], 0
    for pair in _PAIR.finditer(text):
        if pair.start() < done or not secret_name(pair["key"]):
            continue
        value = _VALUE.match(text, pair.end())  # never None: every part of it is optional
        if value is None:
            continue
        kept = pair.end() + len(value["scheme"] or "")
        if value.end() > kept and text[kept : value.end()] != MASKED:
            out += [text[done:kept], MASKED]
            done = value.end()
    return "".join(out) + text[done:]
