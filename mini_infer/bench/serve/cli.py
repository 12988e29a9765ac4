"""``servebench`` (also ``mini-infer bench serve``): benchmark any OpenAI-compatible server (chapter 12).

    servebench --base-url http://127.0.0.1:8000 --dataset random --input-len 256 --output-len 64 \\
        --num-prompts 64 --request-rate 1,2,4,inf --json sweep.json --plot sweep.png
    servebench --dataset shared-prefix --num-groups 8 --prompts-per-group 8 --system-prompt-len 512
    servebench compare ours.json vllm.json --plot compare.png

Each run prints a summary in the layout of vLLM's ``benchmark_serving``; a sweep adds one line
per rate at the end. ``--json`` writes the configuration, every run's metrics and every
request's timeline (times in seconds from the run's first send), from which all metrics can be
recomputed with ``compute_metrics``.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
import sys
from collections.abc import Callable, Coroutine, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, TypeVar

import httpx

from mini_infer.bench.serve.client import ClientConfig, first_model_id
from mini_infer.bench.serve.datasets import (
    BenchRequest,
    TextTokenizer,
    jsonl_dataset,
    random_dataset,
    shared_prefix_dataset,
)
from mini_infer.bench.serve.metrics import GOODPUT_KEYS
from mini_infer.bench.serve.report import format_run, format_summary
from mini_infer.bench.serve.runner import BenchmarkError, RunResult, format_rate, http_client, run_sweep

RESULT_FORMAT_VERSION = 1

# Options that belong to one dataset, with their defaults. They are None on the command line
# so that giving one to another dataset is an error rather than silently ignored.
DATASET_OPTIONS: dict[str, dict[str, Any]] = {
    "random": {"input_len": 1024, "range_ratio": 0.0},
    "shared-prefix": {"num_groups": 64, "prompts_per_group": 16, "system_prompt_len": 2048, "question_len": 128},
    "jsonl": {"dataset_path": None},
}
DEFAULT_RANDOM_PROMPTS = 100
DEFAULT_OUTPUT_LEN = 128


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("mode", nargs="?", choices=["compare"], help="'compare FILE...': compare result files")
    parser.add_argument("files", nargs="*", help="result files written by --json (with 'compare')")
    server = parser.add_argument_group("server")
    server.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root, without /v1")
    server.add_argument("--model", default=None, help="model name to request (default: the first of GET /v1/models)")
    server.add_argument(
        "--api-key", default=os.environ.get("OPENAI_API_KEY"), help="sent as a Bearer token (default: $OPENAI_API_KEY)"
    )
    server.add_argument(
        "--endpoint",
        choices=["completions", "chat"],
        default="completions",
        help="/v1/completions or /v1/chat/completions",
    )
    server.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="ask the server to generate exactly the output length (default: on for random and shared-prefix); "
        "--no-ignore-eos for servers that reject unknown fields",
    )
    server.add_argument("--temperature", type=float, default=0.0)
    server.add_argument("--extra-body", default=None, help="a JSON object merged into every request body")
    server.add_argument(
        "--request-timeout", type=float, default=600.0, help="seconds before one request counts as failed"
    )

    data = parser.add_argument_group("dataset")
    data.add_argument("--dataset", choices=list(DATASET_OPTIONS), default="random")
    data.add_argument(
        "--num-prompts",
        type=int,
        default=None,
        help=f"random: how many (default {DEFAULT_RANDOM_PROMPTS}); others: use the first N (default all)",
    )
    data.add_argument("--input-len", type=int, default=None, help="random: prompt tokens (default 1024)")
    data.add_argument(
        "--output-len",
        type=int,
        default=None,
        help=f"max_tokens (default {DEFAULT_OUTPUT_LEN}; jsonl: the row's output_len)",
    )
    data.add_argument(
        "--range-ratio", type=float, default=None, help="random: lengths uniform in [len(1-r), len(1+r)] (default 0)"
    )
    data.add_argument("--num-groups", type=int, default=None, help="shared-prefix: groups (default 64)")
    data.add_argument(
        "--prompts-per-group", type=int, default=None, help="shared-prefix: prompts per group (default 16)"
    )
    data.add_argument(
        "--system-prompt-len", type=int, default=None, help="shared-prefix: shared system prompt tokens (default 2048)"
    )
    data.add_argument("--question-len", type=int, default=None, help="shared-prefix: question tokens (default 128)")
    data.add_argument("--dataset-path", default=None, help="jsonl: the file")
    data.add_argument(
        "--tokenizer",
        default=None,
        help="tokenizer directory for exact lengths and counts (default: --model if a local directory)",
    )
    data.add_argument("--seed", type=int, default=0)

    load = parser.add_argument_group("load")
    load.add_argument(
        "--request-rate",
        default="inf",
        help="requests/s of Poisson arrivals; 'inf' sends all at once; '1,2,4,inf' sweeps",
    )
    load.add_argument("--max-concurrency", type=int, default=None, help="at most this many requests in flight")
    load.add_argument("--warmup-requests", type=int, default=2, help="requests sent and discarded before measuring")
    load.add_argument(
        "--goodput",
        nargs="+",
        default=None,
        metavar="KEY:MS",
        help="SLO limits, e.g. ttft:500 tpot:50 (keys: ttft, tpot, e2el)",
    )

    out = parser.add_argument_group("output")
    out.add_argument("--json", default=None, metavar="PATH", help="write config, metrics and per-request records")
    out.add_argument(
        "--plot",
        default=None,
        metavar="PATH",
        help="PNG: latency CDFs (one rate), curves against the rate (sweep), or a comparison",
    )
    out.add_argument("--no-progress", action="store_true", help="no progress bar")


# ---------------------------------------------------------------------------- arguments
def parse_rates(text: str) -> list[float]:
    rates = []
    for part in text.split(","):
        try:
            rate = float(part.strip())
        except ValueError:
            raise ValueError(f"--request-rate: {part!r} is not a number or 'inf'") from None
        if not rate > 0:  # also rejects nan
            raise ValueError(f"--request-rate must be positive, got {part!r}")
        rates.append(rate)
    return rates


def parse_goodput(items: Sequence[str] | None) -> dict[str, float]:
    limits: dict[str, float] = {}
    for item in items or []:
        key, sep, value = item.partition(":")
        if not sep or key not in GOODPUT_KEYS:
            raise ValueError(f"--goodput: {item!r} is not KEY:MS with KEY one of {', '.join(GOODPUT_KEYS)}")
        try:
            limits[key] = float(value)
        except ValueError:
            raise ValueError(f"--goodput: {value!r} is not a number of milliseconds") from None
    return limits


def resolve_args(args: argparse.Namespace) -> None:
    """Check the options and fill in the defaults that depend on the dataset (in place)."""
    for dataset, options in DATASET_OPTIONS.items():
        for name, default in options.items():
            value = getattr(args, name)
            if dataset != args.dataset and value is not None:
                raise ValueError(f"--{name.replace('_', '-')} applies only to --dataset {dataset}")
            if value is None:
                setattr(args, name, default)
    if args.dataset == "jsonl" and not args.dataset_path:
        raise ValueError("--dataset jsonl needs --dataset-path")
    if args.num_prompts is None and args.dataset == "random":
        args.num_prompts = DEFAULT_RANDOM_PROMPTS
    if args.output_len is None and args.dataset != "jsonl":
        args.output_len = DEFAULT_OUTPUT_LEN
    if args.ignore_eos is None:
        # Synthetic datasets ask for an output length; a random-weight or small model would
        # otherwise stop at whatever end-of-sequence token it happens to draw.
        args.ignore_eos = args.dataset != "jsonl"
    for name in (
        "num_prompts",
        "input_len",
        "output_len",
        "num_groups",
        "prompts_per_group",
        "system_prompt_len",
        "question_len",
        "max_concurrency",
    ):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {value}")
    if args.range_ratio is not None and not 0.0 <= args.range_ratio < 1.0:
        raise ValueError(f"--range-ratio must be in [0, 1), got {args.range_ratio}")
    if args.warmup_requests < 0:
        raise ValueError("--warmup-requests must not be negative")
    args.request_rates = parse_rates(args.request_rate)
    args.goodput_limits_ms = parse_goodput(args.goodput)
    if args.extra_body is not None:
        extra = json.loads(args.extra_body)
        if not isinstance(extra, dict):
            raise ValueError("--extra-body must be a JSON object")
        args.extra_body = extra
    base = args.base_url.rstrip("/")
    # The OpenAI client's habit is a base URL ending in /v1; the endpoints here add it themselves.
    args.base_url = base.removesuffix("/v1")


def load_tokenizer(name: str | None) -> TextTokenizer | None:
    if name is None:
        return None
    from mini_infer.model_source import SHIPPED_MODELS, resolve_model
    from mini_infer.tokenizer import Tokenizer

    return Tokenizer(resolve_model(name) if name in SHIPPED_MODELS else name)


def dataset_factory(args: argparse.Namespace, tokenizer: TextTokenizer | None) -> Callable[[int], list[BenchRequest]]:
    """A function of the seed that builds the requests of one run."""

    def build(seed: int) -> list[BenchRequest]:
        if args.dataset == "random":
            return random_dataset(args.num_prompts, args.input_len, args.output_len, args.range_ratio, seed, tokenizer)
        if args.dataset == "shared-prefix":
            requests = shared_prefix_dataset(
                args.num_groups,
                args.prompts_per_group,
                args.system_prompt_len,
                args.question_len,
                args.output_len,
                seed,
                tokenizer,
            )
        else:
            requests = jsonl_dataset(args.dataset_path, args.output_len, tokenizer)
            if args.endpoint == "completions" and any(r.prompt is None for r in requests):
                raise ValueError(f"{args.dataset_path} has rows with only 'messages': use --endpoint chat")
        if args.num_prompts is not None:
            if args.num_prompts > len(requests):
                raise ValueError(
                    f"--num-prompts {args.num_prompts} is more than the {len(requests)} prompts of this dataset"
                )
            requests = requests[: args.num_prompts]
        return requests

    return build


def client_config(args: argparse.Namespace) -> ClientConfig:
    """The client's settings: the options of the same names, once ``resolve_args`` filled them in."""
    settings = {f.name: getattr(args, f.name) for f in dataclasses.fields(ClientConfig)}
    settings["extra_body"] = settings["extra_body"] or {}  # no --extra-body: nothing to merge
    return ClientConfig(**settings)


# ---------------------------------------------------------------------------- commands
async def _benchmark(args: argparse.Namespace) -> list[RunResult]:
    async with http_client(args.max_concurrency, args.request_timeout) as client:
        if args.model is None:
            args.model = await first_model_id(client, args.base_url, args.api_key)
            print(f"model: {args.model} (from {args.base_url}/v1/models)")
        tokenizer_name = args.tokenizer or (args.model if Path(args.model).is_dir() else None)
        tokenizer = load_tokenizer(tokenizer_name)
        args.tokenizer = tokenizer_name
        count_tokens = None if tokenizer is None else (lambda text: len(tokenizer.encode(text)))
        return await run_sweep(
            client,
            client_config(args),
            dataset_factory(args, tokenizer),
            args.request_rates,
            max_concurrency=args.max_concurrency,
            seed=args.seed,
            warmup_requests=args.warmup_requests,
            goodput_limits_ms=args.goodput_limits_ms,
            count_tokens=count_tokens,
            show_progress=not args.no_progress,
            on_result=lambda result: print(format_run(result.to_dict()), flush=True),
        )


T = TypeVar("T")


def run_coroutine(coroutine: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run``, also from a Jupyter cell, where an event loop is already running."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coroutine)
    # asyncio.run refuses to nest inside a running loop: give the benchmark a thread of its own.
    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, coroutine).result()


def config_dict(args: argparse.Namespace) -> dict[str, Any]:
    skip = {"mode", "files", "api_key", "request_rate", "goodput", "json", "plot", "no_progress"}
    # Only plain values: a parent CLI may have put other things (a handler function) in args.
    plain = (str, int, float, bool, list, dict, type(None))
    config = {k: v for k, v in vars(args).items() if k not in skip and isinstance(v, plain)}
    config["request_rates"] = [format_rate(r) if math.isinf(r) else r for r in args.request_rates]
    config["api_key"] = "(set)" if args.api_key else None  # never write a secret into a result file
    return config


def run_main(args: argparse.Namespace) -> int:
    try:
        resolve_args(args)
        results = run_coroutine(_benchmark(args))
    except (ValueError, BenchmarkError, OSError) as e:
        hint = ""
        if "ignore_eos" in str(e):
            hint = " (pass --no-ignore-eos if the server rejects the field)"
        print(f"servebench: error: {e}{hint}", file=sys.stderr)
        return 2
    except httpx.HTTPError as e:  # while listing models: the server is down or the URL is wrong
        print(f"servebench: error: cannot reach {args.base_url}: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    runs = [r.to_dict() for r in results]
    if len(runs) > 1:
        print(format_summary([("", run) for run in runs]))
    output = {
        "servebench_format": RESULT_FORMAT_VERSION,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "config": config_dict(args),
        "runs": runs,
    }
    if args.json:
        Path(args.json).write_text(json.dumps(output, indent=1))
        print(f"wrote {args.json}")
    if args.plot:
        from mini_infer.bench.serve.plots import plot_run, plot_sweep

        title = f"{args.model} ({args.dataset}, {args.endpoint})"
        if len(runs) > 1:
            plot_sweep(runs, args.plot, title)
        else:
            plot_run(runs[0], args.plot, title)
        print(f"wrote {args.plot}")
    # A run in which nothing succeeded measured nothing: report it as a failure to scripts.
    return 0 if all(run["metrics"]["completed"] > 0 for run in runs) else 1


def compare_main(args: argparse.Namespace) -> int:
    if not args.files:
        print("servebench: error: compare needs at least one result file", file=sys.stderr)
        return 2
    if args.json:
        print("servebench: error: compare writes no --json; it reads the files it is given", file=sys.stderr)
        return 2
    results = []
    for name in args.files:
        try:
            data = json.loads(Path(name).read_text())
        except (OSError, json.JSONDecodeError) as e:
            print(f"servebench: error: {name}: {e}", file=sys.stderr)
            return 2
        if not isinstance(data, dict) or "runs" not in data:
            print(f"servebench: error: {name} is not a servebench result file", file=sys.stderr)
            return 2
        results.append((Path(name).stem, data))
    rows = [(label, run) for label, data in results for run in data["runs"]]
    print(format_summary(rows))
    if args.plot:
        from mini_infer.bench.serve.plots import plot_compare

        plot_compare(results, args.plot)
        print(f"wrote {args.plot}")
    return 0


def main(args: argparse.Namespace) -> int:
    if args.mode == "compare":
        return compare_main(args)
    if args.files:
        print(f"servebench: error: unexpected arguments {args.files} (did you mean 'compare'?)", file=sys.stderr)
        return 2
    return run_main(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="servebench",
        description=__doc__.split("\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n".join(__doc__.split("\n")[2:6]),
    )
    add_arguments(parser)
    return parser


def cli_main(argv: Sequence[str] | None = None) -> int:
    return main(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(cli_main())
