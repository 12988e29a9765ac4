"""What the server costs: throughput through HTTP against ``LLM.generate`` (chapter 11).

    python -m mini_infer.server.bench_overhead --shape bench-small

One run, one model, one workload (by default 32 prompts of 64 to 256 random tokens, 64 output
tokens each, ignore_eos, greedy, prefix cache off since random prompts share nothing):

* **offline**: ``LLM.generate`` on all prompts at once;
* **server**: ``mini-infer serve`` in a subprocess (as it is deployed: its engine thread and its
  event loop, nothing else), all requests sent at once as streaming completions from this
  process, timed from the first request to the last ``[DONE]``.

Both run at saturation, so the ratio of their output-token throughputs is the share of the
engine's speed the serving layer keeps (HTTP, JSON, SSE, the thread hand-offs and the GIL they
share with the engine thread). Runs alternate (offline, server, offline, ...) and each figure is
the median of ``--repeats``, so a noisy neighbour on a shared machine hurts both sides alike.
This is a benchmark script; tests never time things.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import torch

from mini_infer.llm import LLM
from mini_infer.offline_models import NAMED_SHAPES, add_random_prompt_arguments, random_model_dir, random_prompts
from mini_infer.sampling_params import SamplingParams
from mini_infer.server.background import wait_until_healthy


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def process_cpu_seconds(pid: int) -> float | None:
    """CPU time (user + system, all threads) of a process, from /proc; None where there is none."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def run_offline(llm: LLM, prompts: list[list[int]], output_len: int) -> tuple[float, int, float]:
    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    cpu, start = time.process_time(), time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start, sum(len(o.token_ids) for o in outputs), time.process_time() - cpu


async def _one_stream(client: httpx.AsyncClient, prompt: list[int], output_len: int) -> int:
    body = {
        "model": "bench",
        "prompt": prompt,
        "max_tokens": output_len,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    tokens = 0
    async with client.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise RuntimeError(chunk["error"]["message"])
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
    return tokens


async def run_server(base_url: str, prompts: list[list[int]], output_len: int) -> tuple[float, int]:
    limits = httpx.Limits(max_connections=len(prompts) + 4, max_keepalive_connections=len(prompts) + 4)
    async with httpx.AsyncClient(base_url=base_url, limits=limits, timeout=600) as client:
        start = time.perf_counter()
        counts = await asyncio.gather(*(_one_stream(client, p, output_len) for p in prompts))
        return time.perf_counter() - start, sum(counts)


def start_server(args: argparse.Namespace, path: Path, port: int) -> subprocess.Popen[bytes]:
    command = [
        sys.executable,
        "-m",
        "mini_infer.server",
        "--model",
        str(path),
        "--served-model-name",
        "bench",
        "--port",
        str(port),
        "--dtype",
        args.dtype,
        "--device",
        args.device,
        "--no-enable-prefix-caching",
        "--max-num-batched-tokens",
        str(args.max_num_batched_tokens),
        "--max-num-seqs",
        str(args.max_num_seqs),
        "--log-level",
        "warning",
    ]
    env = dict(os.environ, MINI_INFER_API_KEY="")
    if args.threads is not None:
        env["OMP_NUM_THREADS"] = str(args.threads)  # read by torch when the server imports it
    return subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def wait_ready(base_url: str, server: subprocess.Popen[bytes], timeout: float = 300) -> None:
    try:
        wait_until_healthy(base_url, timeout, alive=lambda: server.poll() is None)
    except RuntimeError:
        raise RuntimeError(f"the server exited: {server.stderr.read().decode() if server.stderr else ''}") from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shape", default="bench-small", choices=sorted(NAMED_SHAPES))
    parser.add_argument("--model", default=None, help="a model directory (default: a random-weight --shape model)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default="cpu")
    add_random_prompt_arguments(parser, num_prompts=32, input_len=(64, 256), output_len=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="torch threads for both sides (default: torch's)")
    parser.add_argument("--json", action="store_true", help="print the figures as one JSON object")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m mini_infer.server.bench_overhead", description=__doc__.split("\n")[0]
    )
    add_arguments(parser)
    args = parser.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    path = Path(args.model) if args.model else random_model_dir(args.shape, args.dtype)
    lo, hi = args.input_len
    llm = LLM(
        str(path),
        dtype=args.dtype,
        device=args.device,
        enable_prefix_caching=False,
        show_progress=False,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
    )
    vocab = llm.engine.runner.model.config.vocab_size
    prompts = random_prompts(vocab, args.num_prompts, args.input_len, args.seed)
    warmup = prompts[: min(4, len(prompts))]

    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    server = start_server(args, path, port)
    offline: list[float] = []
    served: list[float] = []
    offline_cpu: list[float] = []  # CPU microseconds per output token
    server_cpu: list[float] = []
    try:
        wait_ready(base_url, server)
        run_offline(llm, warmup, 8)
        asyncio.run(run_server(base_url, warmup, 8))
        for r in range(args.repeats):
            # The two engines are never busy at once: the server's sits idle in its queue.
            seconds, tokens, cpu = run_offline(llm, prompts, args.output_len)
            offline.append(tokens / seconds)
            offline_cpu.append(cpu / tokens * 1e6)
            gc.collect()
            before = process_cpu_seconds(server.pid)
            seconds, tokens = asyncio.run(run_server(base_url, prompts, args.output_len))
            after = process_cpu_seconds(server.pid)
            served.append(tokens / seconds)
            if before is not None and after is not None:
                server_cpu.append((after - before) / tokens * 1e6)
            print(
                f"run {r + 1}: offline {offline[-1]:.1f} tok/s, server {served[-1]:.1f} tok/s",
                file=sys.stderr,
                flush=True,
            )
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()

    result: dict[str, Any] = {
        "model": args.shape if not args.model else str(path),
        "dtype": args.dtype,
        "device": args.device,
        "num_prompts": args.num_prompts,
        "input_len": [lo, hi],
        "output_len": args.output_len,
        "offline_tok_s": statistics.median(offline),
        "server_tok_s": statistics.median(served),
        "offline_runs": offline,
        "server_runs": served,
    }
    result["ratio"] = result["server_tok_s"] / result["offline_tok_s"]
    # CPU time per token does not depend on what else the machine runs: a steadier view of the
    # server's own cost than wall-clock throughput on a shared CPU.
    result["offline_cpu_us_per_token"] = statistics.median(offline_cpu)
    result["server_cpu_us_per_token"] = statistics.median(server_cpu) if server_cpu else None
    if args.json:
        print(json.dumps(result))
    else:
        print(
            f"model {result['model']} ({args.dtype}, {args.device}); {args.num_prompts} prompts of {lo}-{hi} tokens, "
            f"{args.output_len} output tokens each, greedy, ignore_eos"
        )
        print(f"LLM.generate      {result['offline_tok_s']:8.1f} output tok/s  (median of {args.repeats})")
        print(f"server, streaming {result['server_tok_s']:8.1f} output tok/s  (median of {args.repeats})")
        print(f"server / offline  {result['ratio']:8.1%}")
        if result["server_cpu_us_per_token"] is not None:
            print(
                f"CPU per output token: LLM.generate {result['offline_cpu_us_per_token']:.0f} us, "
                f"server process {result['server_cpu_us_per_token']:.0f} us (its engine thread, event loop and HTTP)"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
