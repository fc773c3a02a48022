"""The front-capacity benchmark (benchmarks.bench_front) at a tiny size: the real front and
HTTP app with the fake scheduler and real client processes. Every token sent arrives, in
order, exactly once (ids and text), and the reported numbers add up. No timing asserts."""

from __future__ import annotations

import os

import pytest

from benchmarks.front_boot import use_radixrt_from
from benchmarks.front_fake_scheduler import token_source
from benchmarks.front_profile import GROUPS, IDLE, group_of
from benchmarks.front_results import RunConfig
from benchmarks.front_rig import FrontRig
from radixrt.hf_dir import load_tokenizer
from radixrt.model.tiny import ensure_tiny_model

STREAMS, TOKENS, INTERVAL_S = 8, 20, 0.005


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(ensure_tiny_model())


@pytest.fixture(scope="module")
def rig(tokenizer):
    source = token_source(tokenizer)
    with FrontRig(
        ensure_tiny_model(), source, len(tokenizer), clients=2, profile=True,
        decode=tokenizer.decode,
    ) as rig:  # fmt: skip
        yield rig


def test_token_source_streams_are_distinct_and_multibyte(tokenizer):
    source = token_source(tokenizer)
    prompts = [source.prompt_ids(i) for i in range(300)]
    assert len({tuple(p) for p in prompts}) == 300
    streams = [tuple(source.stream_tokens(p, 50)) for p in prompts]
    assert len(set(streams)) == 300
    text = tokenizer.decode(source.ids)
    assert any(ord(ch) > 127 for ch in text)  # detokenization sees multi-byte characters


@pytest.mark.parametrize(
    "route,parse,stop",
    [
        ("/generate", "chunks", ()),
        ("/generate", "lines", ("\x00never",)),
        ("/v1/completions", "chunks", ()),
        ("/v1/completions", "lines", ()),
    ],
)
def test_every_token_arrives_in_order_exactly_once(rig, route, parse, stop):
    config = RunConfig(STREAMS, INTERVAL_S, TOKENS, route, parse, stop)
    r = rig.run(config)
    assert r.errors == []  # ids (/generate), counts and the decoded text of every stream
    assert r.tokens_sent == r.tokens_received == STREAMS * TOKENS
    assert r.steps == TOKENS  # all streams start together (the fake scheduler's barrier)
    assert r.clients == 2
    if route == "/generate":
        assert r.events <= r.tokens_received
    assert 0 < r.achieved_tok_s <= r.scheduler_tok_s <= config.offered_tok_s
    assert r.itl_token_ms.p50 <= r.itl_token_ms.p95 <= r.itl_token_ms.p99
    assert r.front.cpu_s > 0 and r.client_cpu_s > 0 and r.scheduler_cpu_s > 0
    assert r.front.wait_s >= 0
    assert r.front.gc_pause_s >= r.front.gc_max_pause_s >= 0
    assert min(r.front.gc_collections) >= 0
    assert r.front_us_per_token == pytest.approx(1e6 * r.front.cpu_s / r.tokens_received)


def test_profile_groups_add_up(rig):
    p = rig.profile(RunConfig(STREAMS, INTERVAL_S, TOKENS))
    assert p.baseline.errors == [] and p.run.errors == []
    assert set(p.seconds_by_group) == {*GROUPS, IDLE}
    shares = p.shares()
    assert set(shares) == set(GROUPS) and sum(shares.values()) == pytest.approx(1.0)
    assert sum(p.us_per_token().values()) == pytest.approx(p.baseline.front_us_per_token)
    assert p.seconds_by_group["detokenize"] > 0
    assert p.seconds_by_group["SSE write (aiohttp, transport)"] > 0
    assert p.seconds_by_group["ZMQ recv + msgpack decode"] > 0


def test_profile_grouping_keys_on_module_paths():
    assert group_of(("/x/radixrt/detokenizer.py", 1, "anything")) == "detokenize"
    assert group_of(("/x/radixrt/detokenizer.py", 1, "_held_back")) == "stop strings"
    assert group_of(("/x/radixrt/server/stop_strings.py", 1, "f")) == "stop strings"
    assert group_of(("/x/radixrt/server/channel.py", 1, "f")) == GROUPS[0]
    assert group_of(("/s/zmq/_future.py", 1, "f")) == GROUPS[0]
    assert group_of(("~", 0, "<method 'encode' of 'msgspec.json.Encoder' objects>")) == GROUPS[3]
    assert group_of(("/s/aiohttp/http_writer.py", 1, "f")) == GROUPS[4]
    assert group_of(("/l/asyncio/selector_events.py", 1, "write")) == GROUPS[4]
    assert group_of(("/l/asyncio/selector_events.py", 1, "_read_ready")) == GROUPS[8]
    assert group_of(("~", 0, "<method 'poll' of 'select.epoll' objects>")) == IDLE
    assert group_of(("~", 0, "<built-in method builtins.len>")) is None  # to its callers


@pytest.mark.parametrize(
    "kw,field",
    [
        ({"streams": 0}, "streams"),
        ({"interval_s": 0.0}, "interval_s"),
        ({"max_tokens": 1}, "max_tokens"),
        ({"route": "/v1/chat"}, "route"),
        ({"parse": "x"}, "parse"),
    ],
)
def test_run_config_rejects_bad_values(kw, field):
    args = {"streams": 4, "interval_s": 0.01, "max_tokens": 8, **kw}
    with pytest.raises(ValueError, match=field):
        RunConfig(**args)


def test_a_front_of_another_checkout(tokenizer, tmp_path):
    """--compare: the front and the fake scheduler run the radixrt of a given checkout (here
    this one, through the same boot path)."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    source = token_source(tokenizer)
    with FrontRig(
        ensure_tiny_model(), source, len(tokenizer), clients=1, decode=tokenizer.decode,
        code_dir=repo,
    ) as rig:  # fmt: skip
        r = rig.run(RunConfig(4, INTERVAL_S, 8))
    assert r.errors == [] and r.tokens_received == 32
    with pytest.raises(RuntimeError, match="imported from"):
        use_radixrt_from(str(tmp_path))  # this process imported radixrt from elsewhere
