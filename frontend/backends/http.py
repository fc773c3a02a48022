"""HTTP backend: a running `radixrt serve`, through its native POST /generate.

Prompts are tokenized here (with the model's tokenizer) and sent as `input_ids`, exactly
as the in-process backend feeds the engine, so a program gives the same results on both.
The tokenizer comes from `model_path`, else from the path the server reports at
GET /get_model_info (which works when client and server share a filesystem).

A radixrt server that has GET /cache_pressure (probed once) also gives programs their
retention holds as the in-process backend does: results carry the request's id, which
POST /release_cache_holds takes, and `cache_pressure()` reads the engine's holds for
run_batch's admission (one GET at a time; a reading is shared by the threads that ask
within PRESSURE_MAX_AGE_S of it unless a result came back or holds were released after it
was asked for, so a caller always sees its own request's hold). Another server (an older
radixrt, SGLang) answers 404 there: then only explicit `cache_ttl_s` hints hold, they
expire on time, and run_batch starts every program at once.

GET /get_server_info (read once) tells whether the server holds back a request whose
uncached prefix another request computes (`holds_back_shared_prefixes`): a radixrt server
reports its `schedule_policy` and `prefix_cache`; any other server counts as one that does not.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import urllib.error
import urllib.request
from typing import Any

from radixrt.config import holds_back_shared_prefixes
from radixrt.sampling import DEFAULT_OPTIONS, RequestOptions, SamplingParams
from radixrt.stats import CachePressure

from ..errors import BackendError
from .base import Backend, DeltaCallback, GenResult

HEALTH_TIMEOUT_S = 10.0
# a GET /cache_pressure answer serves the threads that ask this soon after it arrived (the
# engine's pressure changes once a step, a GPU step takes longer)
PRESSURE_MAX_AGE_S = 0.005
RELEASE_BATCH = 1024  # ids per POST /release_cache_holds (the server's bound)

logger = logging.getLogger(__name__)


class RuntimeEndpoint(Backend):
    """Backend for a radixrt server at `url` (e.g. "http://127.0.0.1:30000").

    Raises BackendError when the server does not answer GET /health, and ValueError when
    no tokenizer can be found (pass `model_path`)."""

    def __init__(
        self,
        url: str,
        model_path: str | None = None,
        api_key: str | None = None,
        timeout: float = 600.0,
    ) -> None:
        self.url = url.rstrip("/")
        self.api_key = api_key
        self.timeout = timeout  # seconds per HTTP request
        self._pressure_lock = threading.Lock()
        # (asked for at, answered at, reading): a reading serves the callers within
        # PRESSURE_MAX_AGE_S of its answer, unless it was asked for before `_changed_at`
        self._pressure: tuple[float, float, CachePressure | None] = (0.0, 0.0, None)
        # when the latest result came back or holds were released (time.monotonic)
        self._changed_at = 0.0
        self._request("GET", "/health", timeout=HEALTH_TIMEOUT_S)
        if model_path is None:
            model_path = self._model_path_from_server()
        from radixrt.hf_dir import load_tokenizer

        self.model_path = model_path
        self.tokenizer = load_tokenizer(model_path)
        probe = self._read_pressure(missing_ok=True, timeout=HEALTH_TIMEOUT_S)
        self.releases_holds = probe is not None
        info = self._request("GET", "/get_server_info", None, HEALTH_TIMEOUT_S, missing_ok=True)
        self.holds_back_shared_prefixes = _holds_back_shared_prefixes(info)

    def _read_pressure(
        self, missing_ok: bool = False, timeout: float | None = None
    ) -> CachePressure | None:
        """GET /cache_pressure as a CachePressure (`held`: the ids `GenResult.rid` carries);
        None when the server has no such route and `missing_ok`."""
        try:
            out = self._request("GET", "/cache_pressure", None, timeout, missing_ok)
        except ValueError as e:  # a 400: not a radixrt answer
            raise BackendError(f"GET {self.url}/cache_pressure failed: {e}") from None
        if out is None and missing_ok:
            return None
        try:
            return CachePressure(**{**out, "held": frozenset(out["held"])})
        except (TypeError, KeyError) as e:
            raise BackendError(f"GET {self.url}/cache_pressure answered {str(out)[:200]}") from e

    def _model_path_from_server(self) -> str:
        """The server's model dir: GET /get_model_info's `model_path`, else the model id of
        GET /v1/models when it is a local directory (the default served model name)."""
        tried = []
        for route in ("/get_model_info", "/v1/models"):
            try:
                info = self._request("GET", route, timeout=HEALTH_TIMEOUT_S)
            except BackendError as e:  # route missing: try the next one
                tried.append(f"{route}: {e}")
                continue
            path = _reported_model_path(info)
            if path is not None and os.path.isdir(path):
                return path
            tried.append(f"{route}: no local model dir in {str(info)[:200]}")
        raise ValueError(
            f"RuntimeEndpoint({self.url!r}) needs the model's tokenizer: pass "
            f"model_path=<local model dir> ({'; '.join(tried)})"
        )

    # ---- Backend ----
    def generate(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        on_delta: DeltaCallback | None = None,
        options: RequestOptions = DEFAULT_OPTIONS,
        lora: str | None = None,
    ) -> GenResult:
        body = {"input_ids": prompt_ids, "sampling_params": sampling_json(params)}
        if lora is not None:  # SGLang's field: the adapter's name
            body["lora_path"] = lora
        if options.cache_salt is not None:  # /generate takes these beside sampling_params
            body["cache_salt"] = options.cache_salt
        if options.priority:
            body["priority"] = options.priority
        if options.cache_ttl_s:
            body["cache_ttl_s"] = options.cache_ttl_s
        if on_delta is None:
            return self._result(self._request("POST", "/generate", body))
        body["stream"] = True
        text = ""
        out: dict[str, Any] = {}
        for event in self._stream("/generate", body):  # SGLang's: everything so far
            new = event.get("text") or ""
            if len(new) > len(text):
                on_delta(new[len(text) :])
                text = new
            out = event
        if not out.get("meta_info", {}).get("finish_reason"):
            raise BackendError(f"the stream from {self.url}/generate ended before finishing")
        return self._result({**out, "text": text})

    def score_continuations(
        self,
        prefix_ids: list[int],
        continuations: list[list[int]],
        cache_salt: str | None = None,
        lora: str | None = None,
    ) -> list[list[float]]:
        body = {
            "input_ids": [prefix_ids + c for c in continuations],
            "sampling_params": {"max_new_tokens": 0},
            "return_prompt_logprob": True,
            "logprob_start_len": max(1, len(prefix_ids)),
        }
        if cache_salt is not None:
            body["cache_salt"] = cache_salt
        if lora is not None:
            body["lora_path"] = lora
        outs = self._request("POST", "/generate", body)
        if not isinstance(outs, list) or len(outs) != len(continuations):
            raise BackendError(f"/generate answered {len(continuations)} prompts with {outs!r}")
        scores = []
        for out, cont in zip(outs, continuations):
            lps = [_logprob(x) for x in out["meta_info"].get("input_token_logprobs") or []]
            if len(lps) != len(cont):
                raise BackendError(
                    f"/generate returned {len(lps)} prompt log-probs for a {len(cont)}-token "
                    "continuation; expected those of tokens [logprob_start_len, prompt_len)"
                )
            scores.append(lps)
        return scores

    def release_cache_holds(self, rids: list[str]) -> None:
        """POST /release_cache_holds (RELEASE_BATCH ids per call). A server that cannot be
        reached ends nothing, which only costs time: its holds expire on their own."""
        if not self.releases_holds:
            return
        rids = list(rids)
        for i in range(0, len(rids), RELEASE_BATCH):
            body = {"rids": rids[i : i + RELEASE_BATCH]}
            try:
                self._request("POST", "/release_cache_holds", body)
            except BackendError as e:
                logger.warning("holds not released (they expire on time): %s", e)
                return
            finally:
                self._changed_at = time.monotonic()

    def cache_pressure(self) -> CachePressure | None:
        """The server's pressure, asked for after the latest result came back (and the
        latest release), answered at most PRESSURE_MAX_AGE_S ago: a thread that asks while
        another one reads waits for that reading rather than sending its own GET."""
        if not self.releases_holds:
            return None
        with self._pressure_lock:
            asked_at, answered_at, pressure = self._pressure
            stale = (
                asked_at < self._changed_at or time.monotonic() - answered_at > PRESSURE_MAX_AGE_S
            )
            if pressure is None or stale:
                asked_at = time.monotonic()
                pressure = self._read_pressure()
                self._pressure = (asked_at, time.monotonic(), pressure)
            return pressure

    def _result(self, out: dict[str, Any]) -> GenResult:
        self._changed_at = time.monotonic()
        result = _result(out)
        if self.releases_holds:
            result.rid = out["meta_info"].get("id")
        return result

    # ---- transport ----
    def _open(self, method: str, path: str, body: Any, timeout: float | None):
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"} if data is not None else {}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        req = urllib.request.Request(self.url + path, data=data, headers=headers, method=method)
        try:
            return urllib.request.urlopen(req, timeout=timeout or self.timeout)
        except urllib.error.HTTPError as e:
            message = _error_message(e)
            if e.code == 400:
                raise ValueError(f"the server rejected the request: {message}") from None
            raise BackendError(f"{method} {self.url}{path} failed: HTTP {e.code}: {message}") from e
        except (urllib.error.URLError, OSError) as e:
            reason = getattr(e, "reason", e)
            raise BackendError(
                f"cannot reach the radixrt server at {self.url} ({method} {path}): {reason}; "
                "is `radixrt serve` running there?"
            ) from e

    def _request(
        self,
        method: str,
        path: str,
        body: Any = None,
        timeout: float | None = None,
        missing_ok: bool = False,
    ):
        """The JSON answer; `missing_ok`: None when the server has no route `path` (404)."""
        try:
            with self._open(method, path, body, timeout) as resp:
                raw = resp.read()
        except BackendError as e:
            cause = e.__cause__
            if missing_ok and isinstance(cause, urllib.error.HTTPError) and cause.code == 404:
                return None
            raise
        return json.loads(raw) if raw.strip() else None

    def _stream(self, path: str, body: Any):
        """Yield the JSON events of an SSE response until `data: [DONE]`."""
        with self._open("POST", path, body, None) as resp:
            for raw in resp:
                line = raw.decode().strip()
                if not line.startswith("data:"):
                    continue
                data = line[len("data:") :].strip()
                if data == "[DONE]":
                    return
                event = json.loads(data)
                if "error" in event:
                    raise BackendError(f"{self.url}{path} stream failed: {event['error']}")
                yield event
        raise BackendError(f"the stream from {self.url}{path} ended without [DONE]")


def sampling_json(params: SamplingParams) -> dict[str, Any]:
    """The /generate `sampling_params` object for SamplingParams (defaults left out)."""
    out: dict[str, Any] = {
        "max_new_tokens": params.max_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "min_p": params.min_p,
        "ignore_eos": params.ignore_eos,
    }
    if params.top_k is not None:
        out["top_k"] = params.top_k
    if params.seed is not None:
        out["seed"] = params.seed
    if params.stop:
        out["stop"] = list(params.stop)
    if params.stop_token_ids:
        out["stop_token_ids"] = list(params.stop_token_ids)
    if params.stop_regex:
        out["stop_regex"] = list(params.stop_regex)
    if params.include_stop_str_in_output:
        out["no_stop_trim"] = True
    if params.min_tokens:
        out["min_new_tokens"] = params.min_tokens
    if params.logit_bias:
        out["logit_bias"] = {str(token): bias for token, bias in params.logit_bias}
    structured = (("regex", "regex"), ("json_schema", "json_schema"), ("grammar", "ebnf"),
                  ("structural_tag", "structural_tag"))  # fmt: skip
    if not params.skip_special_tokens:
        out["skip_special_tokens"] = False
    for name, key in structured:
        if getattr(params, name) is not None:  # structured output
            out[key] = getattr(params, name)
    return out


def _result(out: dict[str, Any]) -> GenResult:
    meta = out["meta_info"]
    reason = meta["finish_reason"]
    return GenResult(
        text=out["text"],
        output_ids=list(out.get("output_ids") or []),
        finish_reason=reason["type"] if isinstance(reason, dict) else reason,
        prompt_tokens=meta["prompt_tokens"],
        completion_tokens=meta["completion_tokens"],
        cached_tokens=meta.get("cached_tokens", 0),
        prompt_logprobs=[_logprob(x) for x in meta.get("input_token_logprobs") or []],
    )


def _holds_back_shared_prefixes(info: Any) -> bool:
    """From GET /get_server_info: a radixrt server reports `schedule_policy` and
    `prefix_cache`; a server without them (an older radixrt, SGLang, no such route) is
    taken to hold nothing back."""
    if not isinstance(info, dict):
        return False
    policy, prefix_cache = info.get("schedule_policy"), info.get("prefix_cache")
    if not isinstance(policy, str) or not isinstance(prefix_cache, str):
        return False
    return holds_back_shared_prefixes(policy, prefix_cache)


def _reported_model_path(info: Any) -> str | None:
    if not isinstance(info, dict):
        return None
    if isinstance(info.get("model_path"), str):
        return info["model_path"]
    data = info.get("data")
    if isinstance(data, list) and data and isinstance(data[0], dict):
        model_id = data[0].get("id")
        return model_id if isinstance(model_id, str) else None
    return None


def _logprob(x: Any) -> float:
    """A log-prob entry: a float, or SGLang's [logprob, token_id, text] triple."""
    return float(x[0] if isinstance(x, (list, tuple)) else x)


def _error_message(e: urllib.error.HTTPError) -> str:
    raw = e.read().decode(errors="replace")
    try:
        return json.loads(raw)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return raw[:500] or e.reason
