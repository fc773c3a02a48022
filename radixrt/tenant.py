"""Who sent a request, as the server resolved its API key (plain data: the front and the
scheduler both carry it)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Tenant:
    """Who sent a request, as the server resolved its API key (separate from its cache salt,
    which a tenant may vary): retention bounds the holds of each tenant."""

    name: str
    # share of the KV pool this tenant's holds may keep (None: the engine's
    # `retention_max_tenant_share`)
    retention_share: float | None = None

    def __post_init__(self) -> None:
        if self.retention_share is not None and not 0 <= self.retention_share <= 1:
            raise ValueError(f"retention_share must be in [0, 1], got {self.retention_share}")
