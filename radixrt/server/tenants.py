"""API keys mapped to tenants, and each tenant's cache salt namespace.

A shared prefix cache is a side channel: a request whose prefix another client sent runs
faster and reports `cached_tokens`, so a client could test whether someone sent a given
prompt. Requests share cached KV only under the same cache salt (`SamplingParams.cache_salt`,
one radix root per salt). With tenants configured, every request's salt is derived from its
API key's tenant and the client's own `cache_salt`, so a client cannot send another tenant's
salt: clients of one tenant share the tenant's cache (and may split it further with their own
`cache_salt`); clients of different tenants share no KV on any tier.

Keys come from a file (`--api-keys-file PATH`) or the environment (`RADIXRT_API_KEYS`), never
the command line (other users can read it): one `KEY TENANT [admin]` entry per line; `#` starts
a comment, stripped before anything else; in the variable (only there) commas also separate
entries. A tenant name is 1..MAX_TENANT_CHARS characters without whitespace. The tenant `-` is
the shared namespace: its keys' requests without a `cache_salt` use the unsalted cache, as a
server without tenants does. `admin` gives the key the admin role: the routes that act on every
tenant (a global cache flush, /metrics, /debug/*, the KV event sources, the router's worker
management behind `--dp`); other keys never reach them. A key shorter than MIN_KEY_CHARS draws a
warning; a tenant named like one of the keys is refused (its columns are swapped).

What a tenant's requests may claim comes from `@TENANT NAME=VALUE ...` lines of the same file
(`TenantPolicy`): `priority=LO..HI` (default 0..0: no tenant can put itself ahead of another),
`default_priority=P` (what a request without a priority gets; default LO if 0 is outside the
range, else 0), `max_cache_ttl_s=S` (default: the engine's cap) and `retention_share=F` (the
share of the KV pool its retention holds may keep, over all its cache salts; default the
engine's `retention_max_tenant_share`). A request outside the first three is a 400 naming the
field and the allowed range; the share bounds the holds in the scheduler, which learns each
request's tenant from the request (`radixrt.scheduler.request.Tenant`), not from its salt.

Sharing across tenants (a common system prompt computed once) is the operator's choice and
its trade-off: tenants that share a namespace (one tenant name, or `-`) can probe each other's
prompts through timing and `cached_tokens`. Give them one tenant name only where that is
acceptable; otherwise each tenant computes the system prompt once for itself.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
from dataclasses import dataclass, field, replace

from aiohttp import web

from radixrt.sampling import RequestOptions
from radixrt.server.messages import SaltScope
from radixrt.server.protocol import ApiError, GenerationSpec, checked
from radixrt.tenant import Tenant

logger = logging.getLogger("radixrt.server")

SHARED_TENANT = "-"  # keys of this tenant use the unsalted (shared) namespace
MAX_TENANT_CHARS = 256
MIN_KEY_CHARS = 16  # shorter keys draw a warning: they can be guessed
ADMIN_ROLE = "admin"
ENV_VAR = "RADIXRT_API_KEYS"
TENANT = "radixrt.tenant"  # key of the authenticated request's tenant in the aiohttp request
ADMIN = "radixrt.admin"  # key of whether the authenticated request may use admin routes


@dataclass(frozen=True)
class TenantPolicy:
    """What one tenant's requests may claim."""

    min_priority: int = 0
    max_priority: int = 0
    default_priority: int = 0  # a request that sends none (or 0) gets this
    max_cache_ttl_s: float | None = None  # None: the engine's cap only
    # share of the KV pool its retention holds may keep (None: retention_max_tenant_share)
    retention_share: float | None = None

    def __post_init__(self) -> None:
        if not self.min_priority <= self.default_priority <= self.max_priority:
            raise ValueError(
                f"default_priority {self.default_priority} is outside priority="
                f"{self.min_priority}..{self.max_priority}"
            )
        if self.max_cache_ttl_s is not None and not self.max_cache_ttl_s >= 0:
            raise ValueError(f"max_cache_ttl_s must be >= 0, got {self.max_cache_ttl_s}")
        if self.retention_share is not None and not 0 <= self.retention_share <= 1:
            raise ValueError(f"retention_share must be in [0, 1], got {self.retention_share}")

    @classmethod
    def parse(cls, options: list[str]) -> TenantPolicy:
        """From `priority=LO..HI`, `default_priority=P`, `max_cache_ttl_s=S`,
        `retention_share=F` (ValueError)."""
        kw: dict[str, object] = {}
        for opt in options:
            name, sep, value = opt.partition("=")
            try:
                if name == "priority" and sep:
                    lo, dots, hi = value.partition("..")
                    if not dots:
                        raise ValueError
                    kw["min_priority"], kw["max_priority"] = int(lo), int(hi)
                elif name == "default_priority" and sep:
                    kw["default_priority"] = int(value)
                elif name in ("max_cache_ttl_s", "retention_share") and sep:
                    kw[name] = float(value)
                else:
                    raise ValueError
            except ValueError:
                raise ValueError(
                    f"{opt!r}: expected priority=LO..HI, default_priority=P, max_cache_ttl_s=S "
                    "or retention_share=F"
                ) from None
        if "default_priority" not in kw:
            lo, hi = kw.get("min_priority", 0), kw.get("max_priority", 0)
            kw["default_priority"] = 0 if lo <= 0 <= hi else lo
        return cls(**kw)  # type: ignore[arg-type]

    def apply(self, options: RequestOptions) -> RequestOptions:
        """`options` checked against the policy (a priority of 0, the schemas' default,
        becomes `default_priority`); ApiError 400 naming the field and the allowed range."""
        priority = options.priority
        if priority == 0:
            priority = self.default_priority
            options = checked(replace, options, priority=priority)
        if not self.min_priority <= priority <= self.max_priority:
            raise ApiError(
                f"priority {priority} is outside the range this key may claim: "
                f"[{self.min_priority}, {self.max_priority}]",
                param="priority",
            )
        ttl = options.cache_ttl_s
        if self.max_cache_ttl_s is not None and ttl > self.max_cache_ttl_s:
            raise ApiError(
                f"cache_ttl_s {ttl:g} is over what this key may claim: "
                f"[0, {self.max_cache_ttl_s:g}]",
                param="cache_ttl_s",
            )
        return options


DEFAULT_POLICY = TenantPolicy()


@dataclass(frozen=True)
class Caller:
    """Who an authenticated request comes from."""

    tenant: str | None  # its tenant (None: the server has no tenants)
    admin: bool  # may use the admin routes


@dataclass(frozen=True)
class Tenants:
    """API key -> tenant name, and the keys of the admin role (frozen after loading)."""

    by_key: dict[str, str] = field(repr=False)  # secrets: never in a log line
    admin_keys: frozenset[str] = field(default=frozenset(), repr=False)  # a subset of by_key
    policies: dict[str, TenantPolicy] = field(default_factory=dict)  # by tenant; else default

    def policy(self, tenant: str) -> TenantPolicy:
        return self.policies.get(tenant) or DEFAULT_POLICY

    def tag(self, tenant: str) -> Tenant:
        """What the scheduler is told of `tenant` with each of its requests."""
        return Tenant(tenant, self.policy(tenant).retention_share)

    def __post_init__(self) -> None:
        for key, tenant in self.by_key.items():
            if not key or any(c.isspace() for c in key):
                raise ValueError("an API key must be non-empty, without whitespace")
            if not 0 < len(tenant) <= MAX_TENANT_CHARS or any(c.isspace() for c in tenant):
                raise ValueError(
                    f"tenant {tenant[:40]!r}: a tenant name has 1..{MAX_TENANT_CHARS} "
                    "characters, no whitespace"
                )
            if tenant in self.by_key:
                raise ValueError(
                    "a tenant is named like one of the keys: is an entry written 'TENANT KEY'? "
                    "Entries are 'KEY TENANT [admin]'"
                )
        if not self.admin_keys <= self.by_key.keys():
            raise ValueError("an admin key must be one of the keys")
        unknown = sorted(self.policies.keys() - self.tenant_names)
        if unknown:
            raise ValueError(f"a policy for tenant {unknown[0][:40]!r}, which has no key")

    @property
    def tenant_names(self) -> set[str]:
        return set(self.by_key.values())

    @classmethod
    def parse(cls, text: str, source: str, commas: bool = False) -> Tenants:
        """`KEY TENANT [admin]` entries, one per line (`commas`: commas separate entries too,
        as in the environment variable); comments are stripped first. ValueError naming
        `source` and the entry for anything else, or a key given twice."""
        by_key: dict[str, str] = {}
        admins: set[str] = set()
        policies: dict[str, TenantPolicy] = {}
        lines = (line.split("#", 1)[0] for line in text.splitlines())
        entries = [e for line in lines for e in (line.split(",") if commas else [line])]
        for n, entry in enumerate(entries, 1):
            parts = entry.split()
            if not parts:
                continue
            where = f"{source}: entry {n}" if commas else f"{source}: line {n}"
            if parts[0].startswith("@"):
                tenant = parts[0][1:]
                if tenant in policies:
                    raise ValueError(f"{where}: a second policy for tenant {tenant[:40]!r}")
                try:
                    policies[tenant] = TenantPolicy.parse(parts[1:])
                except ValueError as e:
                    raise ValueError(f"{where}: {e}") from None
                continue
            if len(parts) not in (2, 3) or (len(parts) == 3 and parts[2] != ADMIN_ROLE):
                raise ValueError(f"{where}: expected 'KEY TENANT' or 'KEY TENANT {ADMIN_ROLE}'")
            key, tenant = parts[:2]
            if len(tenant) >= MIN_KEY_CHARS > len(key):
                raise ValueError(
                    f"{where}: the tenant name is longer than its key: is it written "
                    "'TENANT KEY'? Entries are 'KEY TENANT [admin]'"
                )
            if key in by_key:
                raise ValueError(f"{where}: a key is given twice")
            by_key[key] = tenant
            if len(parts) == 3:
                admins.add(key)
        if not by_key:
            raise ValueError(f"{source}: no 'KEY TENANT' entries")
        try:
            tenants = cls(by_key, frozenset(admins), policies)
        except ValueError as e:
            raise ValueError(f"{source}: {e}") from None
        tenants._log(source)
        return tenants

    def _log(self, source: str) -> None:
        """Counts (never keys) and warnings about short keys."""
        short = sorted({t for k, t in self.by_key.items() if len(k) < MIN_KEY_CHARS})
        if short:
            logger.warning(
                "%s: keys shorter than %d characters (guessable) for tenants %s: use random "
                "keys (e.g. `openssl rand -hex 16`)",
                source, MIN_KEY_CHARS, ", ".join(repr(t[:40]) for t in short[:8]),
            )  # fmt: skip
        if not self.admin_keys:
            logger.warning(
                "%s: no '%s' key: the admin routes (global flush, /metrics, /debug, KV event "
                "sources) answer no one", source, ADMIN_ROLE,
            )  # fmt: skip
        logger.info(
            "%s: %d API keys (%d admin) for %d tenants",
            source, len(self.by_key), len(self.admin_keys), len(self.tenant_names),
        )  # fmt: skip

    @classmethod
    def load(cls, path: str | None) -> Tenants | None:
        """From the file `path`, else from $RADIXRT_API_KEYS, else None (no tenants)."""
        if path is not None:
            with open(path, encoding="utf-8") as f:
                return cls.parse(f.read(), path)
        text = os.environ.get(ENV_VAR)
        return cls.parse(text, ENV_VAR, commas=True) if text else None


def _matches(digest: bytes, key: str) -> bool:
    return hmac.compare_digest(digest, hashlib.sha256(f"Bearer {key}".encode()).digest())


def authenticate(authorization: str, api_key: str | None, tenants: Tenants | None) -> Caller | None:
    """Who sent an `Authorization` header value, or None when the key is missing or wrong.
    With tenants: a key's tenant (admin when the key has the role), `api_key` the shared
    tenant's (not admin). Without tenants the caller has no tenant and is admin: `api_key`
    when one is set, anyone when none is."""
    given = authorization.encode()
    digest = hashlib.sha256(given).digest()
    if tenants is not None:
        found = None
        for key, tenant in tenants.by_key.items():  # every entry compared: no early exit
            if _matches(digest, key):
                found = Caller(tenant, key in tenants.admin_keys)
        if found is not None:
            return found
    if api_key is not None:
        if _matches(digest, api_key):
            return Caller(SHARED_TENANT, False) if tenants is not None else Caller(None, True)
        return None
    return None if tenants is not None else Caller(None, True)


def request_tenant(request: web.Request) -> str | None:
    """The tenant `authenticate` found for `request` (None: the server has no tenants)."""
    return request.get(TENANT)


def request_is_admin(request: web.Request) -> bool:
    """Whether `authenticate` gave `request` the admin role."""
    return request.get(ADMIN, False)


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
    return tenant_scope(tenant).prefix + hashlib.sha256(name.encode()).hexdigest()


def tenant_scope(tenant: str) -> SaltScope:
    """Every cache salt `tenant_salt` gives `tenant`'s requests (they all start with the
    tenant's own prefix); the shared tenant's include the unsalted namespace."""
    digest = hashlib.sha256(f"{len(tenant)}:{tenant}".encode()).hexdigest()[:32]
    return SaltScope(f"tenant:{digest}:", unsalted=tenant == SHARED_TENANT)


def apply_tenant(spec: GenerationSpec, tenant: str | None) -> GenerationSpec:
    """`spec` with the client's cache salt replaced by the tenant's."""
    salt = tenant_salt(tenant, spec.options.cache_salt)
    return replace(spec, options=checked(replace, spec.options, cache_salt=salt))
