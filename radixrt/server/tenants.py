"""API keys mapped to tenants, and each tenant's cache salt namespace.

A shared prefix cache is a side channel: a request whose prefix another client sent runs
faster and reports `cached_tokens`, so a client could test whether someone sent a given
prompt. Requests share cached KV only under the same cache salt (`SamplingParams.cache_salt`,
one radix root per salt). With tenants configured, every request's salt is derived from its
API key's tenant and the client's own `cache_salt`, so a client cannot send another tenant's
salt: clients of one tenant share the tenant's cache (and may split it further with their own
`cache_salt`); clients of different tenants share no KV on any tier.

Keys come from a file (`--api-keys-file PATH`) or the environment (`RADIXRT_API_KEYS`), never
the command line (other users can read it): one `KEY TENANT` pair per line (in the variable,
lines or commas separate the pairs); `#` starts a comment. A tenant name is 1..MAX_TENANT_CHARS
characters without whitespace. The tenant `-` is the shared namespace: its keys' requests
without a `cache_salt` use the unsalted cache, as a server without tenants does.

Sharing across tenants (a common system prompt computed once) is the operator's choice and
its trade-off: tenants that share a namespace (one tenant name, or `-`) can probe each other's
prompts through timing and `cached_tokens`. Give them one tenant name only where that is
acceptable; otherwise each tenant computes the system prompt once for itself.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from dataclasses import dataclass, field

from aiohttp import web

SHARED_TENANT = "-"  # keys of this tenant use the unsalted (shared) namespace
MAX_TENANT_CHARS = 256
ENV_VAR = "RADIXRT_API_KEYS"
TENANT = "radixrt.tenant"  # key of the authenticated request's tenant in the aiohttp request


@dataclass(frozen=True)
class Tenants:
    """API key -> tenant name (frozen after loading)."""

    by_key: dict[str, str] = field(repr=False)  # secrets: never in a log line

    def __post_init__(self) -> None:
        for key, tenant in self.by_key.items():
            if not key or any(c.isspace() for c in key):
                raise ValueError("an API key must be non-empty, without whitespace")
            if not 0 < len(tenant) <= MAX_TENANT_CHARS or any(c.isspace() for c in tenant):
                raise ValueError(
                    f"tenant {tenant[:40]!r}: a tenant name has 1..{MAX_TENANT_CHARS} "
                    "characters, no whitespace"
                )

    @classmethod
    def parse(cls, text: str, source: str) -> Tenants:
        """`KEY TENANT` pairs, one per line or comma-separated; ValueError naming `source`
        and the line for anything else, or a key given twice."""
        by_key: dict[str, str] = {}
        for n, line in enumerate(text.replace(",", "\n").splitlines(), 1):
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            parts = line.split()
            if len(parts) != 2:
                raise ValueError(f"{source}: entry {n}: expected 'KEY TENANT'")
            key, tenant = parts
            if key in by_key:
                raise ValueError(f"{source}: entry {n}: a key is given twice")
            by_key[key] = tenant
        if not by_key:
            raise ValueError(f"{source}: no 'KEY TENANT' entries")
        return cls(by_key)

    @classmethod
    def load(cls, path: str | None) -> Tenants | None:
        """From the file `path`, else from $RADIXRT_API_KEYS, else None (no tenants)."""
        if path is not None:
            with open(path, encoding="utf-8") as f:
                return cls.parse(f.read(), path)
        text = os.environ.get(ENV_VAR)
        return cls.parse(text, ENV_VAR) if text else None


def authenticate(
    authorization: str, api_key: str | None, tenants: Tenants | None
) -> str | None | bool:
    """The tenant of an `Authorization` header value: a tenant key's tenant, the shared
    tenant for `api_key` (with tenants), None when the server has no tenants and the key is
    right (or none is needed); False when the key is missing or wrong."""
    given = authorization.encode()
    if tenants is not None:
        digest = hashlib.sha256(given).digest()
        for key, tenant in tenants.by_key.items():  # every entry compared: no early exit
            if hmac.compare_digest(digest, hashlib.sha256(f"Bearer {key}".encode()).digest()):
                return tenant
    if api_key is not None:
        if hmac.compare_digest(given, f"Bearer {api_key}".encode()):
            return SHARED_TENANT if tenants is not None else None
        return False
    return False if tenants is not None else None


def request_tenant(request: web.Request) -> str | None:
    """The tenant `authenticate` found for `request` (None: the server has no tenants)."""
    return request.get(TENANT)


def tenant_salt(tenant: str | None, client_salt: str | None) -> str | None:
    """The cache salt of a request of `tenant` (None: the server has no tenants) that sent
    `client_salt`. Without tenants the client's salt is used as is; the shared tenant without
    a salt gets the unsalted cache; anything else gets a digest of (tenant, salt), which no
    client can produce for another tenant (a client's salt is only an input to it)."""
    if tenant is None:
        return client_salt
    if tenant == SHARED_TENANT and client_salt is None:
        return None
    name = f"{len(tenant)}:{tenant}:{'' if client_salt is None else '=' + client_salt}"
    return "tenant:" + hashlib.sha256(name.encode()).hexdigest()


def apply_tenant(sampling: dict, tenant: str | None) -> None:
    """Replace the client's `cache_salt` in the SamplingParams keywords `sampling` by the
    tenant's (in place)."""
    salt = tenant_salt(tenant, sampling.pop("cache_salt", None))
    if salt is not None:
        sampling["cache_salt"] = salt
