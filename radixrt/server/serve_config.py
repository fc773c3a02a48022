"""What `radixrt serve` runs: the model, the HTTP front's settings and the engine options
(plain data; radixrt.server.launch serves it, radixrt.server.dp runs replicas of it)."""

from __future__ import annotations

from dataclasses import dataclass, field

from radixrt.server.connections import ConnectionLimits
from radixrt.server.kv_publisher import KVEventsConfig
from radixrt.server.liveness import StallPolicy
from radixrt.server.tenants import Tenants
from radixrt.server.tools import TOOL_PARSERS

EVENT_LOOPS = ("auto", "uvloop", "asyncio")


@dataclass(frozen=True)
class ServeConfig:
    model: str
    host: str = "127.0.0.1"
    port: int = 30000
    api_key: str | None = None
    tenants: Tenants | None = None  # API keys -> tenants (radixrt.server.tenants)
    served_model_name: str | None = None  # /v1/models id; None: the model path
    debug_endpoints: bool = False  # GET /debug/state and integrity checks when idle
    cpu_threads: int | None = None  # scheduler's torch threads on CPU; None: cores - 1
    device: str = "auto"
    dtype: str = "auto"
    options: dict[str, object] = field(default_factory=dict)  # other engine options
    event_loop: str = "auto"  # the front's asyncio loop: auto (uvloop when installed) | ...
    stall: StallPolicy = field(default_factory=StallPolicy)  # when the scheduler is stalled
    connections: ConnectionLimits = field(default_factory=ConnectionLimits)  # HTTP timeouts, cap
    strict_fields: bool = False  # refuse request fields no schema declares (else: a warning)
    incremental_streaming: bool = False  # /generate streams deltas (else SGLang's: all so far)
    kv_events: KVEventsConfig | None = None  # where the scheduler publishes KV events; None: off
    tool_call_parser: str = "auto"  # tool-call format (tools.TOOL_PARSERS); auto: the template's

    def __post_init__(self) -> None:
        if self.tool_call_parser not in ("auto", *TOOL_PARSERS):
            raise ValueError(
                f"tool_call_parser must be auto or one of {TOOL_PARSERS}, got "
                f"{self.tool_call_parser!r}"
            )
        if self.event_loop not in EVENT_LOOPS:
            raise ValueError(f"event_loop must be one of {EVENT_LOOPS}, got {self.event_loop!r}")
        if self.tenants is not None and self.kv_events is not None and self.kv_events.token_ids:
            raise ValueError(
                "--kv-events-token-ids with tenants would publish every tenant's prompts: "
                "with tenants KV events carry only (salted) block hashes"
            )
