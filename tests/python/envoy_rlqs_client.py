#!/usr/bin/env python3
"""Envoy's rate limit quota service (RLQS) driven from outside the Rust stack.

A Python grpcio client that behaves towards quotad's
`envoy.service.rate_limit_quota.v3.RateLimitQuotaService/StreamRateLimitQuotas` as Envoy's
rate_limit_quota filter does, with stubs generated at run time from the .proto files that ship
in the envoy-types crate. The system test `envoy_rlqs` (tests/tests/envoy_rlqs.rs) runs several
against a three-region cluster, steers them on stdin and computes its figures from their logs.

Subcommands:
    generate --envoy-proto DIR --stubs DIR   the stubs, once for every other call
    run      --target H:P --stubs DIR         one Envoy: one stream, commands on stdin
    probe    --target H:P --stubs DIR         bad input and unknown buckets, `ok <point>` each

`run`, as Envoy's client does:
- Reports every 5 s (`--report-s`; Envoy's timer is hard-coded) on its own timer, listing every
  cached bucket (zero usage included) and setting `domain` each time. A bucket is created by
  its first request, which the no-assignment behaviour decides (DENY_ALL), and reported at
  once, alone, with `time_elapsed` 0; later reports carry the whole seconds since the bucket's
  last report.
- Enforces locally. A token bucket assignment is Envoy's TokenBucket: full at `max_tokens`
  when created or replaced, refilled continuously at `tokens_per_fill` per `fill_interval`,
  one token a request. An assignment replaces the bucket only when `max_tokens`,
  `tokens_per_fill` or the sub-second part of `fill_interval` changes; otherwise only its TTL
  is refreshed. TTLs count whole seconds; after one the expired-assignment behaviour
  (`--expired`, DENY_ALL) decides. An abandon action drops the bucket. Actions for buckets
  never reported are ignored. A stream the server ends is opened again at the next report.

Commands on stdin, one a line:
    load <requests/s> <key=value,...>   offered load on the bucket with these entries (0: none)
    quit                                cancel the stream and exit (as does end of input)

Output, one event a line, `<event> <t> ...`, t in seconds on CLOCK_MONOTONIC (one clock for
every process of the host); a bucket is written `key=value,...`, keys sorted:
    start t
    load t bucket rate
    report t bucket allowed denied elapsed_s
    assign t bucket strategy tokens_per_fill max_tokens ttl_s replaced(0|1)
        strategy: token_bucket, allow_all or deny_all (tokens_per_fill, max_tokens 0)
    expire t bucket
    abandon t bucket
    ignored t bucket
    admit t bucket
    end t CODE details      (the server ended the stream)
    quit t

Requires grpcio and grpcio-tools (tests/python/requirements.txt, installed by
scripts/install-test-deps.sh).
"""

import argparse
import importlib
import os
import queue
import sys
import threading
import time

import grpc
from grpc_tools import protoc
from google.protobuf import descriptor_pb2

RLQS_PROTO = "envoy/service/rate_limit_quota/v3/rlqs.proto"
RLQS_MODULE = "envoy.service.rate_limit_quota.v3.rlqs_pb2"

clock = time.monotonic  # CLOCK_MONOTONIC on Linux, shared by every process


class Failed(Exception):
    pass


def expect(cond, what):
    if not cond:
        raise Failed(what)


def generate_stubs(envoy_proto_root, out_dir):
    """Python stubs for rlqs.proto and every file it imports, in `out_dir`."""
    includes = [
        os.path.join(envoy_proto_root, d)
        for d in ("data-plane-api", "xds", "protoc-gen-validate", "googleapis", "cel-spec")
    ]
    well_known = os.path.join(os.path.dirname(protoc.__file__), "_proto")
    args = [f"-I{d}" for d in includes + [well_known]]
    set_path = os.path.join(out_dir, "rlqs.pb")
    run_protoc(args + ["--include_imports", f"--descriptor_set_out={set_path}", RLQS_PROTO])
    files = descriptor_pb2.FileDescriptorSet()
    with open(set_path, "rb") as f:
        files.ParseFromString(f.read())
    # The protobuf runtime ships the well-known types.
    names = [f.name for f in files.file if not f.name.startswith("google/protobuf/")]
    run_protoc(args + [f"--python_out={out_dir}", f"--grpc_python_out={out_dir}"] + names)


def run_protoc(args):
    code = protoc.main(["grpc_tools.protoc"] + args)
    if code != 0:
        raise Failed(f"protoc {' '.join(args[-3:])} exited with {code}")


class Stubs:
    def __init__(self, stubs_dir, target):
        sys.path.insert(0, stubs_dir)
        self.rlqs = importlib.import_module(RLQS_MODULE)
        rlqs_grpc = importlib.import_module(RLQS_MODULE + "_grpc")
        self.channel = grpc.insecure_channel(target)
        grpc.channel_ready_future(self.channel).result(timeout=20)
        self.stub = rlqs_grpc.RateLimitQuotaServiceStub(self.channel)
        self.Reports = self.rlqs.RateLimitQuotaUsageReports
        self.BucketId = self.rlqs.BucketId

    def bucket_id(self, entries):
        b = self.BucketId()
        for k, v in entries.items():
            b.bucket[k] = v
        return b

    def usage(self, entries, elapsed_s, allowed=0, denied=0):
        u = self.Reports.BucketQuotaUsage(
            bucket_id=self.bucket_id(entries),
            num_requests_allowed=allowed,
            num_requests_denied=denied,
        )
        u.time_elapsed.seconds = elapsed_s
        return u


def bucket_key(entries):
    return ",".join(f"{k}={v}" for k, v in sorted(entries.items()))


def parse_bucket(text):
    entries = {}
    for pair in text.split(","):
        k, _, v = pair.partition("=")
        entries[k] = v
    return entries


class Action:
    """A cached bucket action: a blanket rule, or a token bucket's parameters."""

    def __init__(self, strategy, tpf=0, max_tokens=0, fill_s=1.0, fill_nanos=0):
        self.strategy = strategy
        self.tpf = tpf
        self.max_tokens = max_tokens
        self.fill_s = fill_s
        self.fill_nanos = fill_nanos

    def same_token_bucket(self, other):
        """Envoy's test for keeping a token bucket: max_tokens, tokens_per_fill and the
        sub-second part of fill_interval unchanged."""
        return (
            self.strategy == other.strategy == "token_bucket"
            and self.max_tokens == other.max_tokens
            and self.tpf == other.tpf
            and self.fill_nanos == other.fill_nanos
        )


ALLOW_ALL = Action("allow_all")
DENY_ALL = Action("deny_all")


class Bucket:
    def __init__(self, entries, now, fallback):
        self.entries = entries
        self.key = bucket_key(entries)
        self.action = fallback  # the no-assignment behaviour until the first assignment
        self.assigned = False
        self.tokens = 0.0
        self.refilled = now
        self.expires = None
        self.allowed = 0
        self.denied = 0
        self.last_report = now

    def replace(self, action, now):
        self.action = action
        self.tokens = float(action.max_tokens)
        self.refilled = now

    def admit(self, now):
        a = self.action
        if a.strategy == "allow_all":
            return True
        if a.strategy == "deny_all":
            return False
        rate = a.tpf / a.fill_s
        self.tokens = min(float(a.max_tokens), self.tokens + (now - self.refilled) * rate)
        self.refilled = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return True
        return False


class Envoy:
    """One Envoy's quota client: its bucket cache, its stream, its report timer."""

    def __init__(self, stubs, domain, report_s, no_assignment, expired):
        self.s = stubs
        self.domain = domain
        self.report_s = report_s
        self.no_assignment = no_assignment
        self.expired = expired
        self.lock = threading.Lock()
        self.out = threading.Lock()
        self.buckets = {}
        self.loads = {}  # key -> (entries, rate, next arrival)
        self.stream = None
        self.quitting = False

    def log(self, *fields):
        with self.out:
            print(" ".join(str(f) for f in fields), flush=True)

    # --- The stream. -------------------------------------------------------------------
    def open_stream(self):
        requests = queue.Queue()

        def outgoing():
            while True:
                m = requests.get()
                if m is None:
                    return
                yield m

        call = self.s.stub.StreamRateLimitQuotas(outgoing())
        self.stream = (requests, call)
        threading.Thread(target=self.receive, args=(call,), daemon=True).start()

    def send(self, report):
        if self.stream is None:
            self.open_stream()
        self.stream[0].put(report)

    def receive(self, call):
        try:
            for response in call:
                self.on_response(response)
            code, details = "OK", "the server closed the stream"
        except grpc.RpcError as e:
            code, details = e.code().name, (e.details() or "").replace("\n", " ")
        with self.lock:
            if self.stream is not None and self.stream[1] is call:
                self.stream[0].put(None)
                self.stream = None
            quitting = self.quitting
        if not quitting:
            self.log("end", f"{clock():.6f}", code, details or "-")

    def on_response(self, response):
        now = clock()
        with self.lock:
            for action in response.bucket_action:
                key = bucket_key(dict(action.bucket_id.bucket))
                b = self.buckets.get(key)
                if b is None:
                    self.log("ignored", f"{now:.6f}", key)
                    continue
                kind = action.WhichOneof("bucket_action")
                if kind == "abandon_action":
                    del self.buckets[key]
                    self.log("abandon", f"{now:.6f}", key)
                    continue
                self.assign(b, action.quota_assignment_action, now)

    def assign(self, b, qa, now):
        strategy = qa.rate_limit_strategy
        which = strategy.WhichOneof("strategy")
        if which == "token_bucket":
            tb = strategy.token_bucket
            fill = tb.fill_interval
            if fill.seconds + fill.nanos / 1e9 <= 0:
                self.log("unsupported", f"{now:.6f}", b.key, "fill_interval_0")
                return
            new = Action(
                "token_bucket",
                tpf=tb.tokens_per_fill.value if tb.HasField("tokens_per_fill") else 1,
                max_tokens=tb.max_tokens,
                fill_s=fill.seconds + fill.nanos / 1e9,
                fill_nanos=fill.nanos,
            )
        elif which == "blanket_rule":
            allow = strategy.blanket_rule == strategy.BlanketRule.ALLOW_ALL
            new = ALLOW_ALL if allow else DENY_ALL
        else:
            # requests_per_time_unit, or no strategy: outside what quotad sends.
            self.log("unsupported", f"{now:.6f}", b.key, which or "none")
            return
        ttl_s = qa.assignment_time_to_live.seconds
        replaced = not (b.assigned and new.same_token_bucket(b.action))
        if new.strategy != "token_bucket" and b.assigned and b.action.strategy == new.strategy:
            replaced = False
        if replaced:
            b.replace(new, now)
        b.assigned = True
        b.expires = now + ttl_s
        self.log(
            "assign", f"{now:.6f}", b.key, new.strategy, new.tpf, new.max_tokens, ttl_s,
            int(replaced),
        )

    # --- Reports. ----------------------------------------------------------------------
    def report(self, buckets, now, first=False):
        usages = []
        for b in buckets:
            elapsed = 0 if first else int(now - b.last_report)
            usages.append(self.s.usage(b.entries, elapsed, b.allowed, b.denied))
            self.log("report", f"{now:.6f}", b.key, b.allowed, b.denied, elapsed)
            b.allowed = b.denied = 0
            b.last_report = now
        self.send(self.s.Reports(domain=self.domain, bucket_quota_usages=usages))

    # --- Requests. ---------------------------------------------------------------------
    def request(self, entries, now):
        key = bucket_key(entries)
        b = self.buckets.get(key)
        if b is None:
            b = Bucket(entries, now, self.no_assignment)
            self.buckets[key] = b
            ok = b.admit(now)
            if ok:
                self.log("admit", f"{now:.6f}", key)
            # The first request is in the bucket's first report, sent at once.
            b.allowed, b.denied = int(ok), int(not ok)
            self.report([b], now, first=True)
            return
        if b.admit(now):
            b.allowed += 1
            self.log("admit", f"{now:.6f}", key)
        else:
            b.denied += 1

    def expire(self, now):
        for b in self.buckets.values():
            if b.expires is not None and now >= b.expires:
                b.expires = None
                b.replace(self.expired, now)
                self.log("expire", f"{now:.6f}", b.key)

    # --- The loop. ---------------------------------------------------------------------
    def run(self, commands):
        start = clock()
        self.log("start", f"{start:.6f}")
        next_report = start + self.report_s
        while True:
            with self.lock:
                now = clock()
                self.expire(now)
                for key, (entries, rate, due) in list(self.loads.items()):
                    if rate <= 0:
                        continue
                    if now - due > 1.0:
                        due = now  # the host stalled: no burst of a second's arrivals
                    while due <= now:
                        self.request(entries, now)
                        due += 1.0 / rate
                    self.loads[key] = (entries, rate, due)
                if now >= next_report:
                    if self.buckets:
                        self.report(list(self.buckets.values()), now)
                    # Envoy arms its timer again from the callback: periods never shorter.
                    next_report = now + self.report_s
                wake = [next_report]
                wake += [due for _, rate, due in self.loads.values() if rate > 0]
                wake += [b.expires for b in self.buckets.values() if b.expires is not None]
                wait = max(0.0, min(wake) - clock())
            try:
                line = commands.get(timeout=wait)
            except queue.Empty:
                continue
            if line is None or line.strip() == "quit":
                self.quit()
                return
            self.command(line.split())

    def command(self, words):
        if len(words) == 3 and words[0] == "load":
            rate = float(words[1])
            entries = parse_bucket(words[2])
            key = bucket_key(entries)
            now = clock()
            with self.lock:
                self.loads[key] = (entries, rate, now)
            self.log("load", f"{now:.6f}", key, rate)
        else:
            self.log("bad_command", f"{clock():.6f}", "_".join(words) or "-")

    def quit(self):
        with self.lock:
            self.quitting = True
            stream, self.stream = self.stream, None
        if stream is not None:
            stream[1].cancel()
            stream[0].put(None)
        self.log("quit", f"{clock():.6f}")


def read_commands(commands):
    for line in sys.stdin:
        commands.put(line)
    commands.put(None)


# --- probe: bad input and unknown buckets. -------------------------------------------------
def one_exchange(s, reports, timeout=10):
    """Sends `reports` on a fresh stream, keeps it open, and returns the first response or
    the status the stream ended with."""
    requests = queue.Queue()
    for r in reports:
        requests.put(r)

    def outgoing():
        while True:
            m = requests.get()
            if m is None:
                return
            yield m

    call = s.stub.StreamRateLimitQuotas(outgoing(), timeout=timeout)
    try:
        for response in call:
            return response
        return grpc.StatusCode.OK
    except grpc.RpcError as e:
        return e.code()
    finally:
        requests.put(None)
        call.cancel()


def probe_bad_input(s, known):
    cases = {
        "a report without buckets": s.Reports(domain="edge"),
        "a bucket id without entries": s.Reports(
            domain="edge",
            bucket_quota_usages=[s.Reports.BucketQuotaUsage(bucket_id=s.BucketId())],
        ),
    }
    for what, report in cases.items():
        got = one_exchange(s, [report])
        expect(got == grpc.StatusCode.INVALID_ARGUMENT, f"{what}: {got}")
    # The daemon keeps serving: a good report on a new stream is answered.
    got = one_exchange(s, [s.Reports(domain="edge", bucket_quota_usages=[s.usage(known, 0, 1)])])
    expect(not isinstance(got, grpc.StatusCode), f"a good report after them: {got}")
    actions = [a for a in got.bucket_action if dict(a.bucket_id.bucket) == known]
    expect(len(actions) == 1, f"one action for the reported bucket: {got}")
    return "INVALID_ARGUMENT for each; a good report after them answered"


def probe_unknown_buckets(s, unknown):
    """Unknown buckets get the blanket rule of `rlqs_unknown_bucket` (allow_all by default)."""
    buckets = [parse_bucket(u) for u in unknown]
    got = one_exchange(
        s,
        [s.Reports(domain="edge", bucket_quota_usages=[s.usage(b, 0, 1) for b in buckets])],
    )
    expect(not isinstance(got, grpc.StatusCode), f"unknown buckets: {got}")
    seen = []
    for b in buckets:
        actions = [a for a in got.bucket_action if dict(a.bucket_id.bucket) == b]
        expect(len(actions) == 1, f"one action for {b}: {got}")
        qa = actions[0].quota_assignment_action
        strategy = qa.rate_limit_strategy
        expect(
            strategy.WhichOneof("strategy") == "blanket_rule"
            and strategy.blanket_rule == strategy.BlanketRule.ALLOW_ALL,
            f"{b}: ALLOW_ALL: {actions[0]}",
        )
        expect(qa.assignment_time_to_live.seconds >= 1, f"{b}: a TTL of 1 s or more")
        seen.append(bucket_key(b))
    return f"ALLOW_ALL for {' and '.join(seen)}"


def probe(s, known, unknown):
    points = [
        ("bad_input", lambda: probe_bad_input(s, known)),
        ("unknown_buckets", lambda: probe_unknown_buckets(s, unknown)),
    ]
    for name, point in points:
        print(f"ok {name}: {point()}", flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate")
    g.add_argument("--envoy-proto", required=True, help="the envoy-types crate's proto/")
    g.add_argument("--stubs", required=True, help="an empty directory for the stubs")
    r = sub.add_parser("run")
    pr = sub.add_parser("probe")
    for q in (r, pr):
        q.add_argument("--target", required=True, help="host:port of quotad's envoy.listen")
        q.add_argument("--stubs", required=True, help="the directory `generate` filled")
    r.add_argument("--domain", default="edge")
    r.add_argument("--report-s", type=float, default=5.0, help="Envoy's report timer")
    r.add_argument("--expired", choices=["allow_all", "deny_all"], default="deny_all")
    pr.add_argument("--known", required=True, help="a bucket with a policy: key=value,...")
    pr.add_argument("--unknown", action="append", default=[], help="buckets without one")
    a = p.parse_args()
    try:
        if a.cmd == "generate":
            generate_stubs(a.envoy_proto, a.stubs)
            print("ok generate", flush=True)
            return 0
        s = Stubs(a.stubs, a.target)
        if a.cmd == "probe":
            probe(s, parse_bucket(a.known), a.unknown)
            return 0
        envoy = Envoy(
            s,
            a.domain,
            a.report_s,
            no_assignment=DENY_ALL,
            expired=ALLOW_ALL if a.expired == "allow_all" else DENY_ALL,
        )
        commands = queue.Queue()
        threading.Thread(target=read_commands, args=(commands,), daemon=True).start()
        envoy.run(commands)
        return 0
    except (Failed, grpc.RpcError, grpc.FutureTimeoutError) as e:
        print(f"FAILED: {e!r}", flush=True)
        return 1


if __name__ == "__main__":
    sys.exit(main())
