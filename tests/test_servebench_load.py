"""servebench's datasets and arrival times: seeded, in range, sharing what they should (chapter 12)."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any

import pytest

from mini_infer.bench.serve.cli import build_parser, load_tokenizer, parse_goodput, parse_rates, resolve_args
from mini_infer.bench.serve.datasets import (
    TextTokenizer,
    jsonl_dataset,
    random_dataset,
    shared_prefix_dataset,
    uniform_lengths,
)
from mini_infer.bench.serve.runner import poisson_arrival_times

# ------------------------------------------------------------------ arrivals


def test_poisson_arrivals_are_seeded_with_the_right_mean_rate() -> None:
    times = poisson_arrival_times(20_000, rate=5.0, seed=3)
    assert times == poisson_arrival_times(20_000, rate=5.0, seed=3)
    assert times != poisson_arrival_times(20_000, rate=5.0, seed=4)
    assert times[0] == 0.0 and all(b >= a for a, b in zip(times, times[1:]))
    gaps = [b - a for a, b in zip(times, times[1:])]
    # 20,000 exponential gaps: the mean is 1/rate within about 3 standard errors (0.7% each)
    assert statistics.fmean(gaps) == pytest.approx(0.2, rel=0.025)
    # exponential, not regular: the standard deviation equals the mean
    assert statistics.stdev(gaps) / statistics.fmean(gaps) == pytest.approx(1.0, rel=0.05)


def test_infinite_rate_sends_everything_at_once() -> None:
    assert poisson_arrival_times(4, math.inf, seed=0) == [0.0] * 4
    with pytest.raises(ValueError):
        poisson_arrival_times(4, 0.0, seed=0)


def test_rate_and_goodput_parsing() -> None:
    assert parse_rates("1, 2.5,inf") == [1.0, 2.5, math.inf]
    for bad in ("0", "-1", "fast", "nan"):
        with pytest.raises(ValueError):
            parse_rates(bad)
    assert parse_goodput(["ttft:500", "tpot:50.5"]) == {"ttft": 500.0, "tpot": 50.5}
    for items in (["ttft"], ["latency:5"], ["tpot:fast"]):
        with pytest.raises(ValueError):
            parse_goodput(items)


def test_dataset_options_are_checked() -> None:
    parser = build_parser()
    args = parser.parse_args(["--dataset", "shared-prefix", "--base-url", "http://h:8000/v1/"])
    resolve_args(args)
    assert (args.num_groups, args.system_prompt_len, args.output_len, args.ignore_eos) == (64, 2048, 128, True)
    assert args.base_url == "http://h:8000"
    args = parser.parse_args(["--dataset", "jsonl", "--dataset-path", "x.jsonl"])
    resolve_args(args)
    assert (args.output_len, args.ignore_eos) == (None, False)
    for argv, message in (
        (["--dataset", "shared-prefix", "--input-len", "5"], "--input-len applies only to --dataset random"),
        (["--num-groups", "2"], "--num-groups applies only to --dataset shared-prefix"),
        (["--dataset", "jsonl"], "needs --dataset-path"),
        (["--range-ratio", "1.5"], "--range-ratio"),
        (["--max-concurrency", "0"], "--max-concurrency"),
        (["--extra-body", "[1]"], "JSON object"),
    ):
        with pytest.raises(ValueError, match=message):
            resolve_args(parser.parse_args(argv))


# ------------------------------------------------------------------ datasets


def test_uniform_lengths_in_range() -> None:
    import random

    lengths = uniform_lengths(random.Random(0), 2000, 100, 0.25)
    assert min(lengths) == 75 and max(lengths) == 125  # both ends reached: inclusive
    assert uniform_lengths(random.Random(0), 5, 100, 0.0) == [100] * 5
    assert min(uniform_lengths(random.Random(0), 100, 2, 0.9)) >= 1


def test_random_dataset_without_tokenizer() -> None:
    a = random_dataset(50, input_len=40, output_len=20, range_ratio=0.5, seed=1)
    assert a == random_dataset(50, input_len=40, output_len=20, range_ratio=0.5, seed=1)
    assert a != random_dataset(50, input_len=40, output_len=20, range_ratio=0.5, seed=2)
    for r in a:
        assert r.prompt is not None and 20 <= len(r.prompt.split()) <= 60  # one word per token
        assert r.output_len is not None and 10 <= r.output_len <= 30
        assert r.prompt_len is None and r.messages is None
    # prompts differ from their first words: nothing for a prefix cache to share
    assert len({tuple((r.prompt or "").split()[:4]) for r in a}) == len(a)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> TextTokenizer:
    from mini_infer.offline_models import _sample_corpus, build_tokenizer

    # A small vocabulary trained on other words: most of our words split into several tokens,
    # which is the hard case for hitting exact lengths.
    path = tmp_path_factory.mktemp("tokenizer")
    build_tokenizer(_sample_corpus(0, 300), 400).save_pretrained(str(path))
    loaded = load_tokenizer(str(path))
    assert loaded is not None
    return loaded


def test_random_dataset_with_tokenizer_hits_exact_lengths(tokenizer: TextTokenizer) -> None:
    requests = random_dataset(20, input_len=64, output_len=8, range_ratio=0.5, seed=0, tokenizer=tokenizer)
    for r in requests:
        assert r.prompt is not None and r.prompt_len is not None
        assert len(tokenizer.encode(r.prompt)) == r.prompt_len
        assert 32 <= r.prompt_len <= 96
    # The lengths are drawn from the seeded rng before any text, so they can be drawn again here.
    import random

    drawn = uniform_lengths(random.Random(0), 20, 64, 0.5)
    assert [r.prompt_len for r in requests] == drawn


def test_shared_prefix_groups_share_their_prefix(tokenizer: TextTokenizer) -> None:
    requests = shared_prefix_dataset(3, 4, system_prompt_len=30, question_len=6, output_len=5, seed=0)
    assert len(requests) == 12
    assert requests == shared_prefix_dataset(3, 4, system_prompt_len=30, question_len=6, output_len=5, seed=0)
    assert [r.group for r in requests] != sorted(r.group or 0 for r in requests)  # shuffled, groups interleave
    systems: dict[int | None, str] = {}
    for r in requests:
        assert r.messages is not None and r.prompt is not None
        system = r.messages[0]["content"]
        assert r.messages[0]["role"] == "system" and len(system.split()) == 30
        assert systems.setdefault(r.group, system) == system  # one system prompt per group
        assert r.prompt.startswith(system + "\n\n")
        assert r.output_len == 5
    assert len(set(systems.values())) == 3  # and different groups have different ones
    assert len({r.prompt for r in requests}) == 12  # every question is its own
    with_tokens = shared_prefix_dataset(
        2, 2, system_prompt_len=20, question_len=5, output_len=5, seed=0, tokenizer=tokenizer
    )
    for r in with_tokens:
        assert r.prompt_len is not None and r.prompt_len == len(tokenizer.encode(r.prompt or ""))
        assert len(tokenizer.encode((r.messages or [])[0]["content"])) == 20


def test_jsonl_dataset(tmp_path: Path) -> None:
    path = tmp_path / "prompts.jsonl"
    chat = [{"role": "user", "content": "hi"}]
    rows: list[dict[str, Any]] = [{"prompt": "hello", "output_len": 4}, {"messages": chat}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    a, b = jsonl_dataset(path, default_output_len=9)
    assert (a.prompt, a.messages, a.output_len) == ("hello", None, 4)
    assert (b.prompt, b.output_len) == (None, 9)
    assert b.chat_messages() == chat
    assert a.chat_messages() == [{"role": "user", "content": "hello"}]
    for bad, message in (
        ('{"prompt": "a"}\n{oops\n', ":2: not JSON"),
        ('{"text": "a"}\n', ":1: expected an object"),
        ('{"prompt": "a", "output_len": 0}\n', "positive integer"),
        ("\n", "no prompts"),
    ):
        path.write_text(bad)
        with pytest.raises(ValueError, match=message):
            jsonl_dataset(path, default_output_len=None)
