"""What servebench's client costs per streamed token, beside SGLang's client (chapter 12).

    python scripts/servebench_client_cost.py [--peer PATH/TO/bench_serving.py --peer-python PY]

A benchmark client measures itself when its own work per chunk is not small beside the server's.
This takes the server out of the picture: a fake OpenAI completions server (plain asyncio, in a
child process) streams one token chunk to every open stream each ``--step`` seconds, in the bytes
mini-infer sends, and each client runs ``--num-prompts`` requests of ``--output-len`` tokens at
once against it. Printed per client and round: its process's CPU time per chunk, the TTFT and
ITL it measured, and how far apart its requests' start times (from which TTFT counts) fell. The ideal is TTFT about one step and ITL one step; a client whose CPU time nears
the wall time has fallen behind the stream and reports its own backlog as latency.

``--peer`` runs SGLang's ``async_request_openai_completions`` (what ``--backend vllm`` uses) in
``--peer-python``, a Python that can import what bench_serving.py imports.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import socket
import subprocess
import sys
import time
from pathlib import Path

HEAD = 'data: {"id":"cmpl-1","object":"text_completion","created":1,"model":"tiny","system_fingerprint":"fp","choices":'


async def fake_server(port: int, step: float) -> None:
    tick = asyncio.Event()

    async def clock() -> None:
        nonlocal tick
        while True:
            await asyncio.sleep(step)
            tick.set()
            tick = asyncio.Event()

    def chunk(text: str) -> bytes:
        data = text.encode()
        return b"%x\r\n%s\r\n" % (len(data), data)

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:  # keep-alive: one request after another on a connection
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(
                    (int(line[15:]) for line in head.lower().split(b"\r\n") if line.startswith(b"content-length:")), 0
                )
                body = json.loads(await reader.readexactly(length)) if length else {}
                writer.write(
                    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
                )
                usage = (body.get("stream_options") or {}).get("include_usage")
                tail = ',"usage":null}\n\n' if usage else "}\n\n"
                n = body.get("max_tokens", 16)
                for i in range(n):
                    await tick.wait()
                    finish = '"length"' if i == n - 1 else "null"
                    text = '[{"index":0,"text":" word","logprobs":null,"finish_reason":' + finish + "}]"
                    writer.write(chunk(HEAD + text + tail))
                if usage:
                    counts = json.dumps({"prompt_tokens": 128, "completion_tokens": n, "total_tokens": n + 128})
                    writer.write(chunk(HEAD + '[],"usage":' + counts + "}\n\n"))
                writer.write(chunk("data: [DONE]\n\n") + b"0\r\n\r\n")
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    asyncio.ensure_future(clock())
    server = await asyncio.start_server(handle, "127.0.0.1", port, backlog=4096)
    async with server:
        await server.serve_forever()


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def servebench_round(port: int, n: int, output_len: int) -> str:
    from mini_infer.bench.serve.client import ClientConfig
    from mini_infer.bench.serve.datasets import random_dataset
    from mini_infer.bench.serve.metrics import compute_metrics
    from mini_infer.bench.serve.runner import http_client, send_all

    config = ClientConfig(base_url=f"http://127.0.0.1:{port}", endpoint="completions", model="tiny", ignore_eos=True)
    requests = random_dataset(n, 128, output_len, 0.0, 0, None)
    async with http_client(None, 600) as client:
        await send_all(client, config, requests[:2], [0.0, 0.0], None)  # warm-up
        cpu, start = cpu_seconds(), time.perf_counter()
        records = await send_all(client, config, requests, [0.0] * n, None)
        cpu, wall = cpu_seconds() - cpu, time.perf_counter() - start
    m = compute_metrics(records)
    chunks = sum(len(r.chunk_times) for r in records)
    assert m.ttft_ms.mean is not None and m.itl_ms.mean is not None
    starts = [r.send_time for r in records]
    spread = max(starts) - min(starts)
    return line("servebench", chunks, wall, cpu, m.ttft_ms.mean, m.itl_ms.mean, m.failed, spread)


def line(
    name: str, chunks: int, wall: float, cpu: float, ttft_ms: float, itl_ms: float, failed: int, spread: float
) -> str:
    # spread: from the first request's start (where its TTFT counts from) to the last one's; at
    # rate inf a client that sets up requests one after another spreads its own burst.
    return (
        f"{name:<11} {chunks} chunks in {wall:.2f} s; client CPU {cpu:.2f} s = {1e6 * cpu / max(chunks, 1):.1f} us/chunk;"
        f" mean TTFT {ttft_ms:.1f} ms, mean ITL {itl_ms:.2f} ms; starts spread over {1000 * spread:.1f} ms;"
        f" {failed} failed"
    )


# Run in the peer's Python: SGLang's request function, timed the same way.
PEER_ROUND = """
import argparse, asyncio, resource, sys, time
import numpy as np
sys.path.insert(0, sys.argv[1])
import bench_serving as bs
port, n, output_len = map(int, sys.argv[2:5])
bs.args = argparse.Namespace(disable_stream=False, disable_ignore_eos=False, return_logprob=False)
starts = []
session = bs._create_bench_client_session
def stamped_session():  # each request's st is taken right after its session is made
    starts.append(time.perf_counter())
    return session()
bs._create_bench_client_session = stamped_session
def cpu():
    u = resource.getrusage(resource.RUSAGE_SELF)
    return u.ru_utime + u.ru_stime
def one():
    return bs.RequestFuncInput(prompt="word " * 128, api_url=f"http://127.0.0.1:{port}/v1/completions",
        prompt_len=128, output_len=output_len, model="tiny", lora_name=None, image_data=None, extra_request_body={})
async def main():
    await asyncio.gather(*(bs.async_request_openai_completions(one()) for _ in range(2)))
    starts.clear()
    c, t = cpu(), time.perf_counter()
    outs = await asyncio.gather(*(bs.async_request_openai_completions(one()) for _ in range(n)))
    c, t = cpu() - c, time.perf_counter() - t
    ok = [o for o in outs if o.success]
    itl = [x for o in ok for x in o.itl]
    chunks = sum(len(o.itl) + 1 for o in ok)
    ttft = 1000 * float(np.mean([o.ttft for o in ok])) if ok else float("nan")
    print(f"{chunks} {t} {c} {ttft} {1000 * float(np.mean(itl)) if itl else float('nan')} {n - len(ok)} "
          f"{max(starts) - min(starts)}")
asyncio.run(main())
"""


def peer_round(python: str, bench_serving: Path, port: int, n: int, output_len: int) -> str:
    result = subprocess.run(
        [python, "-c", PEER_ROUND, str(bench_serving.parent), str(port), str(n), str(output_len)],
        capture_output=True,
        text=True,
        check=False,
    )
    if result.returncode != 0:
        raise SystemExit(f"SGLang's client failed:\n{result.stderr[-2000:]}")
    chunks, wall, cpu, ttft, itl, failed, spread = result.stdout.split()[-7:]
    return line("sglang", int(chunks), float(wall), float(cpu), float(ttft), float(itl), int(failed), float(spread))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-prompts", type=int, default=256, help="streams at once (default 256)")
    parser.add_argument("--output-len", type=int, default=128, help="chunks per stream (default 128)")
    parser.add_argument("--step", type=float, default=0.02, help="seconds between tokens (default 0.02)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of each client, alternating (default 2)")
    parser.add_argument("--peer", type=Path, default=None, help="SGLang's bench_serving.py (0.5.2)")
    parser.add_argument("--peer-python", default=None, help="a Python that can import what --peer imports")
    parser.add_argument("--serve", type=int, default=None, help=argparse.SUPPRESS)  # the child: serve on this port
    args = parser.parse_args()
    if args.serve is not None:
        asyncio.run(fake_server(args.serve, args.step))
        return 0
    if (args.peer is None) != (args.peer_python is None):
        parser.error("--peer and --peer-python go together")
    if args.peer is not None and not args.peer.is_file():
        parser.error(f"--peer {args.peer}: no such file")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = subprocess.Popen([sys.executable, __file__, "--serve", str(port), "--step", str(args.step)])
    try:
        for _ in range(100):  # wait until it listens
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.05)
        ideal = args.num_prompts * args.output_len / (args.output_len * args.step)
        print(
            f"{args.num_prompts} streams x {args.output_len} chunks, one chunk per stream every {args.step * 1000:g} ms "
            f"(the server's pace: {ideal:,.0f} chunks/s)"
        )
        for _ in range(args.rounds):
            print(asyncio.run(servebench_round(port, args.num_prompts, args.output_len)), flush=True)
            if args.peer is not None:
                print(peer_round(args.peer_python, args.peer, port, args.num_prompts, args.output_len), flush=True)
    finally:
        server.terminate()
        server.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
