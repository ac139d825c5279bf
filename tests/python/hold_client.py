#!/usr/bin/env python3
"""A holder of a concurrency slot that dies holding it.

The system test `concurrency` (tests/tests/concurrency.rs) runs this script as a separate OS
process: it acquires one slot of a concurrency limit (`POST /v1/holds`), prints one JSON line,
then sleeps until the test kills it with SIGKILL, so nothing ever releases the slot: it must come
back at its TTL, and not before.

The line: {"hold_id": ..., "sent_ms": ..., "ttl_ms": ..., "denied": ...}
    sent_ms  wall-clock ms (time.time) just before the first request that named the hold's id:
             the store admitted it no earlier, so the slot expires no earlier than
             sent_ms + ttl_ms (Redis's TIME reads the same clock on this host).
    denied   how many attempts were denied (429) before, each under an id of its own.

A 503 (the store or the home region did not answer: nothing held) or a failed call is retried
under the same id, which names the same hold if an earlier try was held after all. Standard
library only (urllib).
"""

import argparse
import itertools
import json
import sys
import time
import urllib.error
import urllib.request


def post(base, token, path, body, timeout):
    """POSTs `body` as JSON; (status, parsed body), status 0 when the call failed."""
    req = urllib.request.Request(
        base + path,
        data=json.dumps(body).encode(),
        method="POST",
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        raw = e.read()
        try:
            return e.code, json.loads(raw)
        except ValueError:
            return e.code, raw.decode(errors="replace")
    except (urllib.error.URLError, OSError) as e:
        return 0, str(e)


def acquire(args):
    """Acquires a slot; its line, or exits with status 1 at the deadline."""
    deadline = time.monotonic() + args.deadline_s
    denied = 0
    for n in itertools.count():
        hold_id = f"{args.id_prefix}-{n}"
        body = {"tenant": args.tenant, "policy": args.policy, "id": hold_id}
        sent_ms = time.time() * 1000.0
        while True:
            if time.monotonic() > deadline:
                sys.exit(f"no slot within {args.deadline_s} s ({denied} denials)")
            status, answer = post(args.base, args.token, "/v1/holds", body, timeout=5)
            if status == 200:
                return {
                    "hold_id": answer["hold_id"],
                    "sent_ms": sent_ms,
                    "ttl_ms": answer["ttl_ms"],
                    "denied": denied,
                }
            if status == 429:
                denied += 1
                time.sleep(0.02)
                break
            if status in (0, 503):
                time.sleep(0.05)
                continue
            sys.exit(f"hold answered {status}: {answer}")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base", required=True, help="the daemon's API, http://host:port")
    p.add_argument("--token", required=True, help="a bearer token of scope check")
    p.add_argument("--tenant", required=True)
    p.add_argument("--policy", required=True)
    p.add_argument("--id-prefix", required=True, help="holds are named <prefix>-<n>")
    p.add_argument("--deadline-s", type=float, default=30.0)
    args = p.parse_args()
    print(json.dumps(acquire(args)), flush=True)
    # Holds the slot until killed.
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    main()
