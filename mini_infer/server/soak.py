"""A bounded soak of the server: a seeded mix of requests for a set time, then end checks (chapter 11).

    python -m mini_infer.server.soak                 # 300 s on the shipped tiny model
    python -m mini_infer.server.soak --seconds 60 --seed 1 --concurrency 6

It starts a server in this process, on 127.0.0.1 only, with a small KV pool (so that long prompts
preempt) and a small body limit, and drives it from ``--concurrency`` client threads until the
time is up. Each client draws, from its own seeded generator, one request at a time: plain and
streamed completions, streams cancelled after a few chunks, ``n`` > 1, JSON mode, forced tool
calls, long prompts, malformed and oversized bodies, and streams into which a fault is injected
(``mini_infer.faults``, at one of a request's own stages, once the stream has begun). The number
of requests is bounded by the time and the clients: one request per client at a time.

At the end, the checks (any failure: exit status 1):

* no request stuck: the engine is idle within 60 s of the last client's return;
* every KV block free or cached, and the scheduler's invariants hold;
* every outcome is the one its kind expects (a 200, a 400 or 413, an error event naming the
  injected fault), and the server is still healthy;
* ``/metrics`` agrees with the clients: failed requests = faults that fired; successful engine
  requests at least the choices clients saw finish, at most those plus the cancelled ones';
* memory flat: the process's resident memory grows by at most 64 MiB plus 10% from the end of
  the warm-up (the first fifth of the time) to the end (``RSS_BOUND_BYTES``, ``RSS_BOUND_SHARE``).

It prints a report: requests by kind and outcome, tokens, errors by cause, the checks.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import httpx

from mini_infer.faults import inject
from mini_infer.server.app import build_app
from mini_infer.server.background import BackgroundServer
from mini_infer.server.serving import ServerConfig

KINDS = ("plain", "stream", "cancel", "n", "json", "tool", "long", "malformed", "oversized", "fault")
FAULT_STAGES = ("detokenize", "stop_check", "output")
MAX_BODY_BYTES = 64 * 1024
# Memory flat: from the end of the warm-up to the end, resident memory may grow by this much plus
# this share of the warm process (allocator slack, caches filled late by a rare kind of request).
RSS_BOUND_BYTES, RSS_BOUND_SHARE = 64 * 2**20, 0.10
TOOL = {
    "type": "function",
    "function": {
        "name": "weather",
        "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Lima"]}}, "required": ["city"]},
    },
}


@dataclass
class Soak:
    """What the clients saw, shared between their threads (under ``lock``)."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    outcomes: Counter[tuple[str, str]] = field(default_factory=Counter)
    errors: Counter[str] = field(default_factory=Counter)
    choices_finished: int = 0  # engine requests that clients saw finish (stop or length)
    choices_cancelled: int = 0  # engine requests of streams the client closed
    completion_tokens: int = 0
    faults_fired: int = 0
    fault_lock: threading.Lock = field(default_factory=threading.Lock)  # one injected fault at a time

    def record(self, kind: str, outcome: str, *, finished: int = 0, tokens: int = 0, error: str | None = None) -> None:
        with self.lock:
            self.outcomes[kind, outcome] += 1
            self.choices_finished += finished
            self.completion_tokens += tokens
            if error is not None:
                self.errors[error[:80]] += 1


def body_of(kind: str, rng: random.Random) -> tuple[str, dict[str, Any]]:
    """The route and body of one request of ``kind``."""
    words = " ".join(rng.choice(["cat", "sun", "owl", "red", "tea", "map"]) for _ in range(rng.randint(2, 12)))
    base: dict[str, Any] = {"model": "tiny", "max_tokens": rng.randint(4, 24), "temperature": rng.choice([0, 0.8])}
    if kind in ("json", "tool"):
        chat = base | {"messages": [{"role": "user", "content": f"Weather for {words}?"}], "max_tokens": 40}
        if kind == "json":
            return "/v1/chat/completions", chat | {"response_format": {"type": "json_object"}}
        return "/v1/chat/completions", chat | {"tools": [TOOL], "tool_choice": "required"}
    body = base | {"prompt": f"Tell me about {words}."}
    if kind == "n":
        body["n"] = 3
    elif kind == "long":
        # About 250 tokens: with the small pool (768 tokens), a few side by side preempt.
        body["prompt"] = " ".join([words] * (240 // len(words.split())))
    elif kind in ("stream", "cancel", "fault"):
        body |= {"stream": True, "stream_options": {"include_usage": True}}
        if kind == "fault":
            body |= {"max_tokens": 32, "ignore_eos": True}
    return "/v1/completions", body


def one_request(http: httpx.Client, soak: Soak, kind: str, rng: random.Random) -> None:
    if kind == "malformed":
        response = http.post("/v1/completions", content=b'{"model": "tiny", "prompt": ', headers=JSON)
        return soak.record(kind, str(response.status_code))
    if kind == "oversized":
        response = http.post("/v1/completions", content=b"x" * (MAX_BODY_BYTES + 1), headers=JSON)
        return soak.record(kind, str(response.status_code))
    path, body = body_of(kind, rng)
    if not body.get("stream"):
        response = http.post(path, json=body)
        if response.status_code != 200:
            return soak.record(kind, str(response.status_code), error=response.json()["error"]["message"])
        answer = response.json()
        return soak.record(kind, "200", finished=len(answer["choices"]), tokens=answer["usage"]["completion_tokens"])
    with http.stream("POST", path, json=body) as response:
        if response.status_code != 200:
            response.read()
            return soak.record(kind, str(response.status_code), error=response.json()["error"]["message"])
        events = (line.removeprefix("data: ") for line in response.iter_lines() if line)
        if kind == "cancel":
            for _ in range(rng.randint(1, 3)):
                next(events, None)
            with soak.lock:
                soak.choices_cancelled += 1
            return soak.record(kind, "cancelled")  # leaving the block closes the connection mid-stream
        if kind == "fault":
            return fault_stream(soak, events, rng)
        return finish_stream(soak, kind, list(events))


def fault_stream(soak: Soak, events: Any, rng: random.Random) -> None:
    """Read the first chunk (its id names the engine request), inject a fault for that request at
    one of its own stages, and read the rest: an error event naming it, then ``[DONE]``."""
    first = json.loads(next(events))
    with (
        soak.fault_lock,
        inject(rng.choice(FAULT_STAGES), lambda: RuntimeError("injected fault"), first["id"] + "-0") as armed,
    ):
        rest = list(events)
    with soak.lock:
        soak.faults_fired += armed.times_raised
    if not armed.times_raised:  # it finished before the fault was armed
        return finish_stream(soak, "fault", [json.dumps(first), *rest], outcome="finished first")
    error = json.loads(rest[-2]).get("error", {}) if len(rest) >= 2 and rest[-1] == "[DONE]" else {}
    outcome = "error event" if "injected fault" in error.get("message", "") else "wrong end"
    soak.record("fault", outcome, error=error.get("message", "no error event"))


def finish_stream(soak: Soak, kind: str, events: list[str], outcome: str = "200") -> None:
    if not events or events[-1] != "[DONE]":
        return soak.record(kind, "no [DONE]")
    chunks = [json.loads(e) for e in events[:-1]]
    bad = next((c["error"]["message"] for c in chunks if "error" in c), None)
    if bad is not None:
        return soak.record(kind, "error event", error=bad)
    finished = sum(1 for c in chunks for choice in c["choices"] if choice.get("finish_reason"))
    tokens = next((c["usage"]["completion_tokens"] for c in chunks if c.get("usage")), 0)
    soak.record(kind, outcome, finished=finished, tokens=tokens)


JSON = {"Content-Type": "application/json"}
EXPECTED = {
    "malformed": {"400"},
    "oversized": {"413"},
    "cancel": {"cancelled"},
    "fault": {"error event", "finished first"},
}


def client(base_url: str, soak: Soak, seed: int, deadline: float) -> None:
    rng = random.Random(seed)
    with httpx.Client(base_url=base_url, timeout=300) as http:
        while time.monotonic() < deadline:
            kind = rng.choice(KINDS)
            try:
                one_request(http, soak, kind, rng)
            except (httpx.HTTPError, ValueError, KeyError, StopIteration) as exc:
                soak.record(kind, f"client error {type(exc).__name__}", error=str(exc))


def resident_bytes() -> int:
    """This process's resident memory now (Linux's /proc), or on macOS its peak so far."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        import resource  # Unix only: the soak runs on Linux and macOS

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024


def metric(text: str, name: str) -> float:
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))


def run(
    seconds: float, seed: int = 0, concurrency: int = 4, model: str = "tiny"
) -> tuple[Soak, list[str], dict[str, Any]]:
    """Soak a fresh server; what the clients saw, the failed checks (none: it passed), and figures."""
    engine = {"dtype": "float32", "num_kv_blocks": 48, "max_num_seqs": 8}
    config = ServerConfig(model=model, max_body_bytes=MAX_BODY_BYTES, engine_kwargs=engine, show_progress=False)
    soak, failures = Soak(), []
    with BackgroundServer(build_app(config), host="127.0.0.1") as server:
        server.wait_ready(timeout=300)
        engine_of = server.app.state.server.engine
        started = time.monotonic()
        threads = [
            threading.Thread(target=client, args=(server.base_url, soak, seed * 1000 + i, started + seconds))
            for i in range(concurrency)
        ]
        for thread in threads:
            thread.start()
        time.sleep(seconds / 5)
        warm_rss = resident_bytes()
        for thread in threads:
            thread.join()
        idle_by = time.monotonic() + 60
        while engine_of.call(lambda e: e.has_unfinished_requests()).result(timeout=60):
            if time.monotonic() > idle_by:
                failures.append("requests still in the engine 60 s after the clients returned")
                break
            time.sleep(0.1)
        end_rss = resident_bytes()

        def blocks(e: Any) -> tuple[int, int, int, int]:
            e.scheduler.check_invariants()
            cached = e.scheduler.blocks.prefix_cache.num_cached_blocks if e.scheduler.blocks.prefix_cache else 0
            return (
                e.scheduler.blocks.pool.num_free_blocks,
                cached,
                e.scheduler.blocks.pool.num_blocks,
                e.stats()["num_preemptions"],
            )

        free, cached, total, preemptions = engine_of.call(blocks).result(timeout=60)
        with httpx.Client(base_url=server.base_url, timeout=60) as http:
            healthy = http.get("/health").status_code == 200
            text = http.get("/metrics").text
    if free + cached != total:
        failures.append(f"KV blocks: {free} free + {cached} cached of {total}")
    if not healthy:
        failures.append("/health is not 200 at the end")
    unexpected = {k: n for k, n in soak.outcomes.items() if k[1] not in EXPECTED.get(k[0], {"200"})}
    if unexpected:
        failures.append(f"unexpected outcomes: {unexpected}")
    failed, succeeded = (
        metric(text, "mini_infer:request_failure_total"),
        metric(text, "mini_infer:request_success_total"),
    )
    if failed != soak.faults_fired:
        failures.append(
            f"/metrics counts {failed:.0f} failed requests, the clients saw {soak.faults_fired} faults fire"
        )
    if not soak.choices_finished <= succeeded <= soak.choices_finished + soak.choices_cancelled:
        failures.append(f"/metrics counts {succeeded:.0f} successes, the clients saw {soak.choices_finished} finish")
    if end_rss - warm_rss > RSS_BOUND_BYTES + RSS_BOUND_SHARE * warm_rss:
        failures.append(f"memory grew from {warm_rss / 2**20:.0f} MiB to {end_rss / 2**20:.0f} MiB")
    figures = {
        "seconds": seconds,
        "preemptions": preemptions,
        "warm_rss_mib": warm_rss / 2**20,
        "end_rss_mib": end_rss / 2**20,
    }
    return soak, failures, figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mini_infer.server.soak", description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=300.0, help="how long the clients send requests")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--concurrency", type=int, default=4, help="client threads, one request in flight each")
    parser.add_argument("--model", default="tiny")
    args = parser.parse_args(argv)
    if args.seconds <= 0 or args.concurrency < 1:
        parser.error("--seconds must be positive and --concurrency at least 1")
    # The engine logs every failed request with its traceback: here they are the injected faults,
    # counted in the report instead.
    logging.getLogger("mini_infer.engine").setLevel(logging.CRITICAL)
    soak, failures, figures = run(args.seconds, args.seed, args.concurrency, args.model)
    print(report(soak, failures, figures))
    return 1 if failures else 0


def report(soak: Soak, failures: list[str], figures: dict[str, Any]) -> str:
    lines = [f"soak: {figures['seconds']:.0f} s, {sum(soak.outcomes.values())} requests"]
    lines += [f"  {kind:<10} {outcome:<16} {n:5d}" for (kind, outcome), n in sorted(soak.outcomes.items())]
    lines.append(f"completion tokens: {soak.completion_tokens}; choices finished: {soak.choices_finished}")
    lines.append(f"faults fired: {soak.faults_fired}; preemptions: {figures['preemptions']}")
    lines.append(
        f"resident memory: {figures['warm_rss_mib']:.0f} MiB warm, {figures['end_rss_mib']:.0f} MiB at the end"
    )
    lines += ["errors by cause:"] + [f"  {n:5d}  {cause}" for cause, n in soak.errors.most_common()]
    lines += ["checks: all passed"] if not failures else ["checks FAILED:"] + [f"  {f}" for f in failures]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
