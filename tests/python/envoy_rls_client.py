#!/usr/bin/env python3
"""Envoy's rate limit service driven from outside the Rust stack.

A Python grpcio client with stubs generated, at run time, from the .proto files that ship in
the envoy-types crate (the rate limit service) and the tonic-health crate (gRPC health). The
system test `envoy_rls_python` (tests/tests/envoy_rls_python.rs) starts a real quotad with the
Envoy listener, puts the policies below, runs this script and reads its output; it sends
SIGTERM when the script prints `awaiting shutdown`.

Policies the caller puts (tenant/policy: limit per window):
    acme/five     5 per hour        five OK, then OVER_LIMIT
    acme/crowd    20 per hour       exactly 20 of 40 concurrent calls admitted
    all/global    1 per hour        a global limit, spent before the bypass check
    acme/tensec   3 per 10 s        current_limit 18 per MINUTE, limit_remaining 0 when over
    acme/weekly   1 per 7 days      current_limit 1 per WEEK
    acme/reads    2 per hour        hits_addend 0 reads without spending
    acme/small    5 per hour        a cost of 6 is above the burst
    acme/refunds  10 per hour       is_negative_hits gives tokens back

Each point prints `ok <name>` (with figures where there are some); the first failed point
stops the script with exit status 1. Requires grpcio and grpcio-tools (see .ci/run).
"""

import argparse
import concurrent.futures
import importlib
import os
import statistics
import sys
import time

import grpc
from grpc_tools import protoc
from google.protobuf import descriptor_pb2

RLS_PROTO = "envoy/service/ratelimit/v3/rls.proto"
HEALTH_PROTO = "health.proto"
SERVICE_NAME = "envoy.service.ratelimit.v3.RateLimitService"


class Failed(Exception):
    pass


def expect(cond, what):
    if not cond:
        raise Failed(what)


def generate_stubs(envoy_proto_root, health_proto_dir, out_dir):
    """Python stubs for rls.proto, every file it imports, and health.proto, in `out_dir`."""
    includes = [
        os.path.join(envoy_proto_root, d)
        for d in ("data-plane-api", "xds", "protoc-gen-validate", "googleapis", "cel-spec")
    ]
    well_known = os.path.join(os.path.dirname(protoc.__file__), "_proto")
    args = [f"-I{d}" for d in includes + [health_proto_dir, well_known]]
    set_path = os.path.join(out_dir, "rls.pb")
    run_protoc(args + ["--include_imports", f"--descriptor_set_out={set_path}", RLS_PROTO])
    files = descriptor_pb2.FileDescriptorSet()
    with open(set_path, "rb") as f:
        files.ParseFromString(f.read())
    # The protobuf runtime ships the well-known types.
    names = [f.name for f in files.file if not f.name.startswith("google/protobuf/")]
    run_protoc(
        args
        + [f"--python_out={out_dir}", f"--grpc_python_out={out_dir}"]
        + names
        + [HEALTH_PROTO]
    )
    sys.path.insert(0, out_dir)


def run_protoc(args):
    code = protoc.main(["grpc_tools.protoc"] + args)
    if code != 0:
        raise Failed(f"protoc {' '.join(args[-3:])} exited with {code}")


class Client:
    def __init__(self, target):
        self.rls = importlib.import_module("envoy.service.ratelimit.v3.rls_pb2")
        rls_grpc = importlib.import_module("envoy.service.ratelimit.v3.rls_pb2_grpc")
        self.common = importlib.import_module(
            "envoy.extensions.common.ratelimit.v3.ratelimit_pb2"
        )
        self.health = importlib.import_module("health_pb2")
        health_grpc = importlib.import_module("health_pb2_grpc")
        self.channel = grpc.insecure_channel(target)
        grpc.channel_ready_future(self.channel).result(timeout=10)
        self.stub = rls_grpc.RateLimitServiceStub(self.channel)
        self.health_stub = health_grpc.HealthStub(self.channel)
        Response = self.rls.RateLimitResponse
        self.OK = Response.OK
        self.OVER = Response.OVER_LIMIT
        self.Unit = Response.RateLimit

    def descriptor(self, entries, hits=None):
        d = self.common.RateLimitDescriptor(
            entries=[self.common.RateLimitDescriptor.Entry(key=k, value=v) for k, v in entries]
        )
        if hits is not None:
            d.hits_addend.value = hits
        return d

    def check(self, tenant, policy, hits=None):
        return self.descriptor([("tenant", tenant), ("policy", policy)], hits)

    def request(self, descriptors, domain="edge", hits_addend=0):
        return self.rls.RateLimitRequest(
            domain=domain, descriptors=descriptors, hits_addend=hits_addend
        )

    def call(self, descriptors, **kw):
        return self.stub.ShouldRateLimit(self.request(descriptors, **kw), timeout=5)


def header(response, key):
    values = [h.value for h in response.response_headers_to_add if h.key == key]
    return values[0] if values else None


def five_then_over(c):
    seen = []
    for _ in range(6):
        r = c.call([c.check("acme", "five")])
        seen.append((r.overall_code, r.statuses[0].limit_remaining))
    expect(
        seen == [(c.OK, 4), (c.OK, 3), (c.OK, 2), (c.OK, 1), (c.OK, 0), (c.OVER, 0)],
        f"five OK then OVER_LIMIT: {seen}",
    )
    return "5 OK, then OVER_LIMIT"


def concurrent_calls(c):
    n = 20
    started = time.perf_counter()
    futures = [c.stub.ShouldRateLimit.future(c.request([c.check("acme", "crowd")]), timeout=10)
               for _ in range(2 * n)]
    codes = [f.result().overall_code for f in futures]
    took_ms = (time.perf_counter() - started) * 1000
    admitted = codes.count(c.OK)
    expect(admitted == n and codes.count(c.OVER) == n, f"{admitted} of {2 * n} admitted")
    return f"{admitted} of {2 * n} concurrent calls admitted for a limit of {n} ({took_ms:.1f} ms)"


def latency(c):
    samples = []
    for _ in range(200):
        t0 = time.perf_counter()
        c.call([c.descriptor([("remote_address", "10.0.0.1")])])
        samples.append((time.perf_counter() - t0) * 1000)
    return f"p50 {statistics.median(samples):.2f} ms over {len(samples)} calls"


def malformed_beside_spent_global(c):
    global_ = c.check("all", "global")
    expect(c.call([global_]).overall_code == c.OK, "the global limit's one token")
    # A tenant value with a dot, as a client header could carry it.
    bad = c.check("ac.me", "five")
    r = c.call([bad, global_])
    expect(r.overall_code == c.OVER, f"one malformed descriptor beside a spent global: {r}")
    codes = [s.code for s in r.statuses]
    expect(codes == [c.OVER, c.OVER], f"each descriptor over: {codes}")
    expect(not r.statuses[0].HasField("current_limit"), "a refusal names no limit")
    expect(r.statuses[1].current_limit.requests_per_unit == 1, "the global limit stated")
    return "OVER_LIMIT, not an error"


def malformed_each_on_its_own(c):
    good = c.check("acme", "reads", hits=0)
    cases = {
        "a malformed tenant": c.check("ac.me", "five"),
        "no entries": c.descriptor([]),
        "an empty key": c.descriptor([("tenant", "acme"), ("", "x")]),
        "two tenant entries": c.descriptor([("tenant", "acme"), ("tenant", "globex")]),
        "a bad policy name": c.check("acme", "no such"),
    }
    override = c.check("acme", "five")
    override.limit.requests_per_unit = 1
    override.limit.unit = 1
    cases["a limit override"] = override
    for what, d in cases.items():
        r = c.call([good, d])
        codes = [s.code for s in r.statuses]
        expect(
            r.overall_code == c.OVER and codes == [c.OK, c.OVER],
            f"{what}: decided on its own, refused as OVER_LIMIT: {codes}",
        )
    unknown = c.call([c.check("nobody", "five"), c.descriptor([("path", "/")])])
    expect(
        unknown.overall_code == c.OK
        and all(s.code == c.OK and not s.HasField("current_limit") for s in unknown.statuses),
        f"unknown tenant, no tenant entry: OK without a limit: {unknown}",
    )
    return f"{len(cases)} kinds refused per descriptor; unknown ones OK"


def invalid_requests(c):
    for what, req in {
        "an empty domain": c.request([c.check("acme", "five")], domain=""),
        "no descriptors": c.request([]),
    }.items():
        try:
            c.stub.ShouldRateLimit(req, timeout=5)
        except grpc.RpcError as e:
            expect(e.code() == grpc.StatusCode.INVALID_ARGUMENT, f"{what}: {e.code()}")
        else:
            raise Failed(f"{what} was answered")
    return "empty domain and no descriptors: INVALID_ARGUMENT"


def current_limit_exact(c):
    seen = []
    for _ in range(4):
        r = c.call([c.check("acme", "tensec")])
        s = r.statuses[0]
        limit = s.current_limit
        expect(
            (limit.requests_per_unit, limit.unit) == (18, c.Unit.MINUTE),
            f"3 per 10 s as 18 per MINUTE: {limit}",
        )
        seen.append((s.code, s.limit_remaining))
    expect(seen == [(c.OK, 2), (c.OK, 1), (c.OK, 0), (c.OVER, 0)], f"limit_remaining: {seen}")
    weekly = c.call([c.check("acme", "weekly")]).statuses[0].current_limit
    expect((weekly.requests_per_unit, weekly.unit) == (1, c.Unit.WEEK), f"1 a week: {weekly}")
    return "18/MINUTE for 3 per 10 s, 1/WEEK, limit_remaining 0 when over"


def headers_on_every_decided(c):
    r = c.call([c.check("acme", "weekly"), c.check("acme", "tensec")])
    policy = header(r, "ratelimit-policy") or ""
    limits = header(r, "ratelimit") or ""
    expect('"weekly";' in policy and '"tensec";q=3;w=10' in policy, f"RateLimit-Policy {policy}")
    expect('"weekly";r=0' in limits and '"tensec";r=' in limits, f"RateLimit {limits}")
    expect(header(r, "retry-after") is not None, "Retry-After when over")
    expect(all(s.HasField("current_limit") for s in r.statuses), "every status states its limit")
    return "RateLimit-Policy, RateLimit, Retry-After"


def cost_above_burst(c):
    r = c.call([c.check("acme", "small", hits=6)])
    s = r.statuses[0]
    expect(r.overall_code == c.OVER and s.limit_remaining == 0, f"cost 6 over a burst of 5: {r}")
    expect(s.current_limit.requests_per_unit == 5, f"with its limit: {s.current_limit}")
    expect(header(r, "ratelimit-policy") == '"small";q=5;w=3600', f"fields: {r}")
    expect(header(r, "ratelimit") == '"small";r=5;t=3600', f"nothing spent: {r}")
    return "OVER_LIMIT with current_limit and fields"


def hits_addend_zero(c):
    read = c.check("acme", "reads", hits=0)
    for _ in range(3):
        r = c.call([read])
        expect((r.overall_code, r.statuses[0].limit_remaining) == (c.OK, 2), f"a read: {r}")
    for _ in range(2):
        expect(c.call([c.check("acme", "reads")]).overall_code == c.OK, "a spend")
    r = c.call([read])
    expect((r.overall_code, r.statuses[0].limit_remaining) == (c.OVER, 0), f"empty: {r}")
    # The request's hits_addend 0 is the proto's "not set": one hit.
    r = c.call([c.check("acme", "small")], hits_addend=0)
    expect(r.statuses[0].limit_remaining == 4, f"hits_addend 0 on the request spends one: {r}")
    return "reads spend nothing; OVER_LIMIT once empty"


def refund(c):
    """is_negative_hits gives tokens back: `remaining` rises by them, never above the burst."""
    r = c.call([c.check("acme", "refunds", hits=6)])
    expect((r.overall_code, r.statuses[0].limit_remaining) == (c.OK, 4), f"spent 6 of 10: {r}")
    back = c.check("acme", "refunds", hits=3)
    back.is_negative_hits = True
    r = c.call([back])
    expect((r.overall_code, r.statuses[0].limit_remaining) == (c.OK, 7), f"3 given back: {r}")
    r = c.call([c.check("acme", "refunds")])
    expect(r.statuses[0].limit_remaining == 6, f"the next check sees them: {r}")
    back = c.check("acme", "refunds", hits=100)
    back.is_negative_hits = True
    r = c.call([back])
    expect((r.overall_code, r.statuses[0].limit_remaining) == (c.OK, 10), f"capped at 10: {r}")
    return "remaining 4 -> 7 after a refund of 3; capped at the burst"


def health(c):
    h = c.health
    serving = h.HealthCheckResponse.SERVING
    for name in ("", "ratelimit", SERVICE_NAME):
        got = c.health_stub.Check(h.HealthCheckRequest(service=name), timeout=5).status
        expect(got == serving, f"Check {name!r}: {got}")
    try:
        c.health_stub.Check(h.HealthCheckRequest(service="other"), timeout=5)
    except grpc.RpcError as e:
        expect(e.code() == grpc.StatusCode.NOT_FOUND, f"Check 'other': {e.code()}")
    else:
        raise Failed("Check on an unknown service was answered")
    unknown = c.health_stub.Watch(h.HealthCheckRequest(service="other"), timeout=30)
    first = next(unknown)
    expect(first.status == h.HealthCheckResponse.SERVICE_UNKNOWN, f"Watch 'other': {first}")
    return "SERVING for '', ratelimit and the service; unknown: NOT_FOUND, SERVICE_UNKNOWN", unknown


def drain(c, unknown):
    h = c.health
    watch = c.health_stub.Watch(h.HealthCheckRequest(service="ratelimit"), timeout=30)
    first = next(watch)
    expect(first.status == h.HealthCheckResponse.SERVING, f"before SIGTERM: {first}")
    print("awaiting shutdown", flush=True)
    seen = []
    try:
        for message in watch:
            seen.append(message.status)
    except grpc.RpcError as e:
        # The stream may end with the connection instead of a clean end.
        expect(e.code() != grpc.StatusCode.DEADLINE_EXCEEDED, "the watch never ended")
    expect(h.HealthCheckResponse.NOT_SERVING in seen, f"NOT_SERVING during the drain: {seen}")
    # The unknown service's watch was kept open until the drain ended it.
    try:
        rest = list(unknown)
    except grpc.RpcError as e:
        expect(e.code() != grpc.StatusCode.DEADLINE_EXCEEDED, "the unknown watch never ended")
        rest = []
    expect(all(m.status == h.HealthCheckResponse.SERVICE_UNKNOWN for m in rest), f"{rest}")
    return "NOT_SERVING, then the watch ended"


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", required=True, help="host:port of quotad's envoy.listen")
    p.add_argument("--envoy-proto", required=True, help="the envoy-types crate's proto/")
    p.add_argument("--health-proto", required=True, help="the tonic-health crate's proto/")
    p.add_argument("--stubs", required=True, help="an empty directory for the stubs")
    a = p.parse_args()
    generate_stubs(a.envoy_proto, a.health_proto, a.stubs)
    c = Client(a.target)
    points = [
        ("five_then_over", five_then_over),
        ("concurrent", concurrent_calls),
        ("malformed_beside_spent_global", malformed_beside_spent_global),
        ("malformed_each_on_its_own", malformed_each_on_its_own),
        ("invalid_requests", invalid_requests),
        ("current_limit", current_limit_exact),
        ("headers", headers_on_every_decided),
        ("cost_above_burst", cost_above_burst),
        ("hits_addend_zero", hits_addend_zero),
        ("refund", refund),
        ("latency", latency),
    ]
    try:
        for name, point in points:
            print(f"ok {name}: {point(c)}", flush=True)
        said, unknown = health(c)
        print(f"ok health: {said}", flush=True)
        print(f"ok drain: {drain(c, unknown)}", flush=True)
    except (Failed, grpc.RpcError) as e:
        print(f"FAILED: {e}", flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
