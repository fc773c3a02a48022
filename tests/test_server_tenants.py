"""Tenants on the server: API keys from a file or the environment mapped to tenants, each
tenant's cache salt namespace, `cache_salt` and `priority` honoured on every route, and a live
server on which one tenant's prompt is never a cache hit for another and one tenant neither
sees nor releases another's retention holds."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest
from server_utils import http_call, serving, sse_events
from test_server_fields import chat, comp, gen

from radixrt.sampling import RequestOptions
from radixrt.server.protocol import ApiError
from radixrt.server.tenants import (
    SHARED_TENANT,
    Caller,
    TenantPolicy,
    Tenants,
    apply_tenant,
    authenticate,
    tenant_salt,
)


def test_keys_parse_from_lines_or_commas():
    t = Tenants.parse("# keys\nk1 acme\nk2 acme  # same tenant\n\nk3 -\n", "file")
    assert t.by_key == {"k1": "acme", "k2": "acme", "k3": SHARED_TENANT}
    assert Tenants.parse("k1 a, k2 b", "env", commas=True).by_key == {"k1": "a", "k2": "b"}
    for bad in ("k1", "k1 a b", "k1 a\nk1 b", "", "# nothing", "k1 a, k2 b"):
        with pytest.raises(ValueError):
            Tenants.parse(bad, "file")


def test_keys_file_comments_are_stripped_before_anything_else(caplog):
    """A comment with a comma is a comment (it once yielded the key 'rotate' of the tenant
    'monthly'); commas separate entries only in the environment variable."""
    key = "0123456789abcdef0123"
    text = f"# production keys, rotate monthly\n{key} acme  # owner: ops, team b\n"
    for commas in (False, True):
        t = Tenants.parse(text, "src", commas=commas)
        assert t.by_key == {key: "acme"}
        assert authenticate("Bearer rotate", None, t) is None
    with pytest.raises(ValueError, match="line 1"):
        Tenants.parse(f"{key} a, {key}x b", "file")  # a comma in a file is no separator


def test_keys_file_roles_warnings_and_counts(caplog):
    strong, admin = "k" * 20, "a" * 24
    with caplog.at_level("INFO", logger="radixrt.server"):
        t = Tenants.parse(f"{strong} acme\nshort beta\n{admin} ops admin\n", "keys")
    assert t.admin_keys == {admin}
    assert authenticate(f"Bearer {admin}", None, t) == Caller("ops", True)
    assert authenticate(f"Bearer {strong}", None, t) == Caller("acme", False)
    log = caplog.text
    assert "3 API keys (1 admin) for 3 tenants" in log
    assert "shorter than 16 characters" in log and "'beta'" in log
    assert strong not in log and admin not in log and "short " not in log  # never a key
    for bad, match in [
        (f"{strong} acme root", "KEY TENANT admin"),  # only the admin role exists
        (f"acme {strong}", "longer than its key"),  # columns swapped
        (f"{strong} {admin}\n{admin} x", "named like one of the keys"),
    ]:
        with pytest.raises(ValueError, match=match):
            Tenants.parse(bad, "keys")
    caplog.clear()
    with caplog.at_level("WARNING", logger="radixrt.server"):
        Tenants.parse(f"{strong} acme", "keys")
    assert "no 'admin' key" in caplog.text


def test_tenant_policies_bound_what_requests_claim():
    key = "k" * 20
    t = Tenants.parse(
        f"{key} acme\n{key}2 beta\n@beta priority=-5..5 default_priority=2 max_cache_ttl_s=60\n",
        "keys",
    )
    assert t.policy("acme") == TenantPolicy(0, 0, 0, None)  # no claims without a policy
    assert t.policy("beta") == TenantPolicy(-5, 5, 2, 60.0)
    asked = RequestOptions(cache_salt="s", cache_ttl_s=30.0)
    # the schemas' default becomes the tenant's; the rest is kept
    assert t.policy("beta").apply(asked) == replace(asked, priority=2)
    assert t.policy("beta").apply(replace(asked, priority=-4)).priority == -4
    for policy, kw, param in [
        (t.policy("acme"), {"priority": -1}, "priority"),
        (t.policy("beta"), {"priority": 6}, "priority"),
        (t.policy("beta"), {"priority": -5, "cache_ttl_s": 61.0}, "cache_ttl_s"),
    ]:
        with pytest.raises(ApiError) as e:
            policy.apply(RequestOptions(**kw))
        assert (e.value.status, e.value.param) == (400, param)
    assert TenantPolicy.parse(["priority=3..9"]).default_priority == 3  # 0 is out of range
    for bad in (
        f"{key} a\n@a priority=5",
        f"{key} a\n@a priority=1..0",
        f"{key} a\n@a colour=red",
        f"{key} a\n@a default_priority=1",
        f"{key} a\n@b priority=0..1",
        f"{key} a\n@a max_cache_ttl_s=-1",
    ):
        with pytest.raises(ValueError):
            Tenants.parse(bad, "keys")


def test_keys_load_from_file_or_environment(tmp_path, monkeypatch):
    monkeypatch.delenv("RADIXRT_API_KEYS", raising=False)
    assert Tenants.load(None) is None
    monkeypatch.setenv("RADIXRT_API_KEYS", "ke a, kf b")
    assert Tenants.load(None).by_key == {"ke": "a", "kf": "b"}
    path = tmp_path / "keys"
    path.write_text("kf b\n")
    assert Tenants.load(str(path)).by_key == {"kf": "b"}  # the file wins


def test_authenticate_maps_keys_to_tenants():
    t = Tenants({"ka": "a", "kb": "b", "kc": "c"}, frozenset({"kc"}))
    assert authenticate("Bearer ka", None, t) == Caller("a", False)
    assert authenticate("Bearer kb", "shared", t) == Caller("b", False)
    assert authenticate("Bearer kc", "shared", t) == Caller("c", True)
    assert authenticate("Bearer shared", "shared", t) == Caller(SHARED_TENANT, False)
    assert authenticate("Bearer nope", "shared", t) is None
    assert authenticate("", None, t) is None
    assert authenticate("Bearer x", "x", None) == Caller(None, True)
    assert authenticate("Bearer y", "x", None) is None
    assert authenticate("", None, None) == Caller(None, True)


def test_a_tenant_cannot_send_another_tenants_salt():
    assert tenant_salt(None, "s") == "s" and tenant_salt(None, None) is None
    assert tenant_salt(SHARED_TENANT, None) is None
    salts = {
        tenant_salt(t, s)
        for t in ("a", "b", "a:", SHARED_TENANT)
        for s in (None, "s", "a", ":s", "b:s")
    } - {None}
    assert len(salts) == 19  # every (tenant, salt) pair its own namespace
    # what a client of b would send to reach a's namespace is hashed under b again
    assert tenant_salt("b", tenant_salt("a", None)) != tenant_salt("a", None)
    spec = comp(cache_salt="s", priority=-3)
    salted = apply_tenant(spec, "a")
    assert salted.options == replace(spec.options, cache_salt=tenant_salt("a", "s"))
    assert salted.sampling == spec.sampling and spec.options.cache_salt == "s"
    assert apply_tenant(comp(), SHARED_TENANT).options.cache_salt is None
    assert apply_tenant(spec, None) == spec


def test_cache_salt_and_priority_are_honoured_on_every_route():
    for spec in (comp(cache_salt="s", priority=-3), chat(cache_salt="s", priority=-3)):
        assert spec.options.cache_salt == "s" and spec.options.priority == -3
    g = gen(cache_salt="s", priority=2).gen
    assert g.options.cache_salt == "s" and g.options.priority == 2
    assert comp().options == RequestOptions()
    for call, fields, param in [
        (comp, {"cache_salt": ""}, "cache_salt"),
        (chat, {"priority": 2**31}, "priority"),
        (gen, {"priority": -(2**31) - 1}, "priority"),
    ]:
        with pytest.raises(ApiError) as e:
            call(**fields)
        assert (e.value.status, e.value.param) == (400, param)


def test_tenants_share_no_cache_on_a_live_server(tiny_model_dir, tmp_path):
    keys = tmp_path / "keys"
    # "admin": the shared namespace's key, with the admin role (the teardown reads /debug)
    keys.write_text("key-a acme\nkey-a2 acme\nkey-b beta\nadmin - admin\n")
    prompt = "A shared system prompt that is long enough to fill several blocks of KV: " * 3

    def cached(srv, key, **extra):
        body = {"text": prompt, "sampling_params": {"max_new_tokens": 1}, **extra}
        status, out = http_call(srv.url + "/generate", body, {"Authorization": f"Bearer {key}"})
        assert status == 200, out
        return out["meta_info"]["cached_tokens"]

    with serving(tiny_model_dir, "--api-keys-file", str(keys), api_key="admin") as srv:
        assert cached(srv, "key-a") == 0
        assert cached(srv, "key-b") == 0  # another tenant: computed again
        assert cached(srv, "key-a2") > 0  # the same tenant shares
        assert cached(srv, "key-a", cache_salt="x") == 0  # a salt of its own within acme
        assert cached(srv, "key-b", cache_salt="x") == 0  # ... which b's "x" is not
        assert cached(srv, "admin") == 0  # --api-key: the shared (unsalted) namespace
        assert cached(srv, "admin") > 0
        status, _ = http_call(srv.url + "/generate", {"text": "x"}, {"Authorization": "Bearer z"})
        assert status == 401
        # what every tenant's traffic shows is the admin role's (a bearer token for Prometheus)
        for path in ("/metrics", "/debug/state", "/kv_event_sources"):
            for key, status in (("key-a", 403), ("key-b", 403), ("admin", 200)):
                got, out = http_call(
                    srv.url + path, None, {"Authorization": f"Bearer {key}"}, method="GET"
                )
                assert got == status, (path, key, out)
            assert http_call(srv.url + path, None, method="GET")[0] == 401


def test_cache_ttl_s_is_honoured_and_reported():
    from radixrt.server.messages import SchedulerSnapshot
    from radixrt.server.metrics import ServerMetrics
    from radixrt.stats import EngineStats

    assert comp(cache_ttl_s=30).options.cache_ttl_s == 30
    assert gen(cache_ttl_s=2.5).gen.options.cache_ttl_s == 2.5
    with pytest.raises(ApiError) as e:
        chat(cache_ttl_s=-1)
    assert e.value.param == "cache_ttl_s"
    metrics = ServerMetrics()
    snap = SchedulerSnapshot(EngineStats(retention_holds=3, retention_held_blocks=5))
    metrics.update(snap)
    text = metrics.render().decode()
    assert "radixrt_retention_held_blocks 5.0" in text and "radixrt_retention_holds 3.0" in text


def test_a_tenant_sees_and_releases_only_its_own_holds(tiny_model_dir, tmp_path):
    """Another tenant's request ids behave as unknown ones on /cache_pressure and
    /release_cache_holds, even when it sent the same rid; keys of one tenant share them."""
    keys = tmp_path / "keys"
    keys.write_text("key-a acme\nkey-a2 acme\nkey-b beta\nadmin - admin\n")
    body = {"text": "An agent's context to hold. " * 4, "sampling_params": {"max_new_tokens": 2}}

    def call(srv, key, path, payload=None):
        headers = {"Authorization": f"Bearer {key}"}
        method = "GET" if payload is None else "POST"
        status, out = http_call(srv.url + path, payload, headers, method=method)
        assert status == 200, out
        return out

    def held(srv, key):
        return call(srv, key, "/cache_pressure")["held"]

    def release(srv, key, rid):
        return call(srv, key, "/release_cache_holds", {"rids": [rid]})["released"]

    with serving(tiny_model_dir, "--api-keys-file", str(keys), api_key="admin") as srv:
        call(srv, "key-a", "/generate", {**body, "rid": "job", "cache_ttl_s": 60})
        assert held(srv, "key-a2") == ["job"]  # the same tenant
        assert held(srv, "key-b") == [] and held(srv, "admin") == []
        assert release(srv, "key-b", "job") == 0 and release(srv, "admin", "job") == 0
        call(srv, "key-b", "/generate", {**body, "rid": "job", "cache_ttl_s": 60})
        assert held(srv, "key-b") == ["job"] == held(srv, "key-a")
        assert call(srv, "key-b", "/cache_pressure")["held_blocks"] > 0
        assert release(srv, "key-b", "job") == 1
        assert held(srv, "key-b") == [] and held(srv, "key-a") == ["job"]
        assert release(srv, "key-a2", "job") == 1
        assert call(srv, "key-a", "/cache_pressure")["held_blocks"] == 0


def test_control_routes_act_only_on_the_callers_tenant(tiny_model_dir, tmp_path):
    """/abort finds only the caller's requests and rids are per tenant (another tenant's rid
    is neither an error nor visible); server ids are random; a tenant's /flush_cache empties
    only its own cache and an admin's everything; /cache_pressure shows a tenant its own."""
    keys = tmp_path / "keys"
    keys.write_text(
        "key-a acme\nkey-b beta\nadmin - admin\n"
        "@beta priority=-10..10 default_priority=5 max_cache_ttl_s=30\n"
    )
    long_body = {
        "text": "A long job of tenant a",
        "rid": "job",
        "stream": True,
        "sampling_params": {"max_new_tokens": 1900, "ignore_eos": True, "temperature": 0},
    }
    prompts = {k: f"The cached context of {k}, long enough to fill some blocks. " * 3 for k in "ab"}

    def call(srv, key, path, payload=None):
        headers = {"Authorization": f"Bearer {key}"}
        method = "GET" if payload is None else "POST"
        status, out = http_call(srv.url + path, payload, headers, method=method)
        assert status == 200, (path, out)
        return out

    def cached(srv, key, text):
        body = {"text": text, "sampling_params": {"max_new_tokens": 1}}
        return call(srv, key, "/generate", body)["meta_info"]["cached_tokens"]

    with serving(tiny_model_dir, "--api-keys-file", str(keys), api_key="admin") as srv:
        events = sse_events(srv.url + "/generate", long_body, {"Authorization": "Bearer key-a"})
        next(events)  # a's job is running
        assert call(srv, "key-b", "/abort", {"rid": "job"})["aborted"] == 0
        body = {"text": "b's own job", "rid": "job", "sampling_params": {"max_new_tokens": 2}}
        assert call(srv, "key-b", "/generate", body)["meta_info"]["id"] == "job"
        ids = [call(srv, "key-b", "/generate", {"text": "x"})["meta_info"]["id"] for _ in "12"]
        assert all(re.fullmatch(r"[0-9a-f]{32}", i) for i in ids) and ids[0] != ids[1], ids
        assert call(srv, "key-b", "/abort", {"rid": ids[0]})["aborted"] == 0
        assert call(srv, "key-a", "/abort", {"rid": "job"})["aborted"] == 1
        last = list(events)[-1]
        assert last["meta_info"]["finish_reason"]["type"] == "abort"
        assert last["meta_info"]["completion_tokens"] < 1900

        for k in "ab":
            assert cached(srv, f"key-{k}", prompts[k]) == 0
        out = call(srv, "key-b", "/flush_cache", {})
        assert out["scope"] == "tenant" and out["freed_blocks"] > 0, out
        assert cached(srv, "key-a", prompts["a"]) > 0  # a's cache survives b's flush
        assert cached(srv, "key-b", prompts["b"]) == 0
        mine = call(srv, "key-b", "/cache_pressure")
        assert mine["free_blocks"] is None and mine["evictable_blocks"] is None, mine
        assert isinstance(call(srv, "admin", "/cache_pressure")["free_blocks"], int)
        assert call(srv, "admin", "/flush_cache", {})["scope"] == "all"
        assert cached(srv, "key-a", prompts["a"]) == 0

        # claims: a tenant without a policy may not claim a priority; beta within its range
        def claim(key, **fields):
            body = {"text": "claim", "sampling_params": {"max_new_tokens": 1}, **fields}
            return http_call(srv.url + "/generate", body, {"Authorization": f"Bearer {key}"})

        for key, fields, param, allowed in [
            ("key-a", {"priority": -(2**31)}, "priority", "[0, 0]"),
            ("key-a", {"priority": 1}, "priority", "[0, 0]"),
            ("key-b", {"priority": -11}, "priority", "[-10, 10]"),
            ("key-b", {"cache_ttl_s": 31}, "cache_ttl_s", "[0, 30]"),
        ]:
            status, out = claim(key, **fields)
            assert (status, out["error"]["param"]) == (400, param), out
            assert allowed in out["error"]["message"], out
        assert claim("key-b", priority=-10, cache_ttl_s=30)[0] == 200
        call(srv, "admin", "/flush_cache", {})  # ends the hold it took
        status, out = http_call(
            srv.url + "/v1/completions",
            {"prompt": "claim", "max_tokens": 1, "priority": 3},
            {"Authorization": "Bearer key-a"},
        )
        assert (status, out["error"]["param"]) == (400, "priority"), out


def test_one_tenants_holds_leave_another_its_cache(tiny_model_dir, tmp_path):
    """The trial's scenario on a 256-block pool: tenant a sends 40 prompts with `cache_ttl_s`
    (each under a salt of its own) between the rounds of tenant b's five system prompts. a's
    holds stay within its share (default 0.25 of the pool; they once took 0.8, and a bound
    per salt let a escape with many salts), so b's prompts keep their cached tokens; a keys
    file's `retention_share=` sets another tenant's bound."""
    keys = tmp_path / "keys"
    keys.write_text(
        "key-a acme\nkey-b beta\nkey-c gamma\nadmin - admin\n@gamma retention_share=0.1\n"
    )
    system = [[100 + 50 * i + j for j in range(80)] for i in range(5)]  # b: 5 blocks each

    def generate(srv, key, ids, **fields):
        body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 1}, **fields}
        status, out = http_call(srv.url + "/generate", body, {"Authorization": f"Bearer {key}"})
        assert status == 200, out
        return out["meta_info"]["cached_tokens"]

    def pressure(srv, key):
        headers = {"Authorization": f"Bearer {key}"}
        status, out = http_call(srv.url + "/cache_pressure", None, headers, method="GET")
        assert status == 200, out
        return out

    args = ("--api-keys-file", str(keys), "--num-kv-blocks", "256")
    with serving(tiny_model_dir, *args, api_key="admin") as srv:
        b_cached = []
        for rnd in range(5):
            for i in range(8):  # 100 tokens with the output: 7 blocks
                n = 8 * rnd + i
                ids = [1000 + (n * 37 + j) % 1000 for j in range(100)]
                generate(srv, "key-a", ids, cache_ttl_s=600, cache_salt=f"a{n}")
            b_cached.append(sum(generate(srv, "key-b", ids) for ids in system))
        assert b_cached[0] == 0 and b_cached[1:] == [5 * 79] * 4, b_cached
        mine = pressure(srv, "key-a")
        assert mine["max_held_blocks"] == 64 and 0 < mine["held_blocks"] <= 64, mine
        assert pressure(srv, "key-c")["max_held_blocks"] == 25
        assert http_call(srv.url + "/flush_cache", {}, srv.headers())[0] == 200  # ends the holds
