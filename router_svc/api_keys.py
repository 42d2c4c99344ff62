"""The router's API keys and the tenants they name (docs/architecture.md, The router's front door).

Keys come from ``--api-key KEY`` (repeatable) and ``$HALFMOON_API_KEY`` (both tenant ``default``)
and from ``--api-key-file F``: one ``<tenant> <key>`` per line, ``#`` starts a comment, blank lines
are skipped; a tenant may hold several keys (rotation), a key belongs to one tenant. With no key at
all the router is open and every caller is tenant ``anonymous``.

Keys are held only as SHA-256 digests and looked up with :func:`hmac.compare_digest` against every
stored digest (no early exit), so neither the time of a lookup nor anything logged, counted or
returned reveals a key; error messages name the file and line, never the text on it.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

DEFAULT_TENANT = "default"      # keys from --api-key / $HALFMOON_API_KEY
ANONYMOUS = "anonymous"         # every caller when no key is configured
ENV_VAR = "HALFMOON_API_KEY"
# A tenant name is a metric label value and the prefix of worker-side request ids ("<tenant>/<id>"),
# so it must be short and must not contain the separator.
TENANT_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")


class KeyFileError(ValueError):
    """An API key file that cannot be used; the message names the file and line, not its text."""


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


@dataclass
class ApiKeys:
    """Key digests -> tenant. Empty means open (no authentication).

    Attributes:
        entries: (sha256 digest of a key, tenant) pairs.
        tenants: every tenant name, sorted; ``("anonymous",)`` when open.
    """

    entries: list[tuple[bytes, str]] = field(default_factory=list)

    @property
    def enabled(self) -> bool:
        return bool(self.entries)

    @property
    def tenants(self) -> tuple[str, ...]:
        return tuple(sorted({t for _, t in self.entries})) if self.entries else (ANONYMOUS,)

    def add(self, key: str, tenant: str, where: str) -> None:
        """Add one key. Raises KeyFileError (naming ``where``) for an empty key, a bad tenant name,
        or a key already given to another tenant."""
        if not key:
            raise KeyFileError(f"{where}: empty API key")
        if not TENANT_RE.match(tenant) or tenant == ANONYMOUS:
            raise KeyFileError(f"{where}: tenant name must match {TENANT_RE.pattern} and not be "
                               f"{ANONYMOUS!r}")
        d = _digest(key)
        for other_d, other_t in self.entries:
            if hmac.compare_digest(d, other_d):
                if other_t != tenant:
                    raise KeyFileError(f"{where}: this key is already given to tenant {other_t!r}")
                return
        self.entries.append((d, tenant))

    def tenant_of(self, key: str | None) -> str | None:
        """The tenant of ``key``, None when it is missing or unknown; ``anonymous`` when open.
        Compares against every stored digest, in constant time each."""
        if not self.entries:
            return ANONYMOUS
        if not key:
            return None
        d = _digest(key)
        found = None
        for stored, tenant in self.entries:
            if hmac.compare_digest(d, stored):
                found = tenant
        return found


def parse_key_file(path: str | Path, keys: ApiKeys) -> None:
    """Add the keys of ``path`` (``<tenant> <key>`` lines) to ``keys``.

    Raises:
        KeyFileError: unreadable file, a line that is not two fields, a bad tenant name, a key of
            two tenants, or a file without any key.
    """
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise KeyFileError(f"--api-key-file {p}: cannot read: {type(exc).__name__}: "
                           f"{getattr(exc, 'strerror', None) or 'not UTF-8'}") from None
    n = 0
    for lineno, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        fields = line.split()
        if len(fields) != 2:
            raise KeyFileError(f"--api-key-file {p}:{lineno}: expected '<tenant> <key>', got "
                               f"{len(fields)} field(s)")
        keys.add(fields[1], fields[0], f"--api-key-file {p}:{lineno}")
        n += 1
    if n == 0:
        raise KeyFileError(f"--api-key-file {p}: holds no key (lines '<tenant> <key>')")


def file_is_private(path: str | Path) -> bool:
    """False when group or others may read ``path`` (the start-up log warns then)."""
    return not (os.stat(path).st_mode & (stat.S_IRGRP | stat.S_IROTH))


def load_keys(api_keys: Iterable[str] = (), key_file: str = "", env: dict | None = None) -> ApiKeys:
    """All keys of the flags and the environment (``env`` defaults to ``os.environ``).

    Raises:
        KeyFileError: see :func:`parse_key_file`; also an empty ``--api-key``.
    """
    keys = ApiKeys()
    for i, k in enumerate(api_keys):
        keys.add(k.strip(), DEFAULT_TENANT, f"--api-key #{i + 1}")
    env_key = (os.environ if env is None else env).get(ENV_VAR, "").strip()
    if env_key:
        keys.add(env_key, DEFAULT_TENANT, f"${ENV_VAR}")
    if key_file:
        parse_key_file(key_file, keys)
    return keys


def bearer_token(value: str | None) -> str | None:
    """The key of an ``Authorization: Bearer <key>`` value (scheme case-insensitive), else None."""
    if not value:
        return None
    scheme, _, token = value.strip().partition(" ")
    if scheme.lower() != "bearer":
        return None
    return token.strip() or None


__all__ = ["ANONYMOUS", "ApiKeys", "DEFAULT_TENANT", "ENV_VAR", "KeyFileError", "TENANT_RE", "bearer_token",
           "file_is_private", "load_keys", "parse_key_file"]
