"""``--tensor-parallel-size`` on the commands that build engines (chapter 14), two ranks on gloo:
the benchmarks that keep two engines build one tensor-parallel engine at a time, and give the
figures of one rank; every engine command has the flag."""

from __future__ import annotations

import json
import multiprocessing
from contextlib import redirect_stdout
from io import StringIO
from pathlib import Path
from typing import Any

import pytest

from mini_infer.cli import build_parser
from mini_infer.cli import main as cli_main
from mini_infer.cli_options import engine_kwargs

pytestmark = pytest.mark.timeout(180)  # a hung collective fails its test, not the run


def _bench(argv: list[str], out: Path) -> tuple[dict[str, Any], str]:
    printed = StringIO()
    with redirect_stdout(printed):
        assert cli_main([*argv, "--json", str(out)]) == 0, printed.getvalue()
    return json.loads(out.read_text()), printed.getvalue()


def test_the_prefix_cache_benchmark_runs_two_ranks_one_engine_at_a_time(tiny_model_dir: Path, tmp_path: Path) -> None:
    # As the chapter 08 smoke test: a budget of 32 tokens admits the prompts one after another, so
    # that most find their group's system prompt cached (the command exits 1 below 80% of it, or
    # when the outputs with and without the cache differ).
    argv = ["bench", "prefix-cache", "--model", str(tiny_model_dir), "--groups", "2", "--prompts-per-group", "3"]
    argv += ["--system-len", "32", "--question-len", "3", "8", "--max-tokens", "3", "--repeats", "2"]
    argv += ["--max-num-batched-tokens", "32"]
    # Two engines alive at once on two ranks would be refused (one torch.distributed world per
    # process): this run passing means they were built one after the other.
    two_ranks, printed = _bench([*argv, "--tensor-parallel-size", "2"], tmp_path / "two.json")
    one_rank, printed_one = _bench(argv, tmp_path / "one.json")
    assert "split over 2 ranks" in printed and "one 2-rank engine at a time" in printed
    assert "interleaved" in printed_one and "sequential" not in printed_one
    assert (two_ranks["order"], one_rank["order"]) == ("sequential", "interleaved")
    assert two_ranks["tensor_parallel_size"] == 2 and two_ranks["outputs_equal"]
    assert 0 < two_ranks["hit_tokens"] == one_rank["hit_tokens"] <= two_ranks["shareable_tokens"]
    assert two_ranks["runs"]["on"][0]["hits_per_request"] == one_rank["runs"]["on"][0]["hits_per_request"]
    assert len(two_ranks["runs"]["off"]) == len(two_ranks["runs"]["on"]) == 2
    assert not multiprocessing.active_children()


def test_the_speculative_benchmark_splits_the_target_and_keeps_the_draft_on_rank_0(tmp_path: Path) -> None:
    argv = ["bench", "speculative", "--k", "1,3", "--num-prompts", "3", "--max-tokens", "10", "--repeats", "1"]
    argv += ["--dtype", "float32"]
    two_ranks, printed = _bench([*argv, "--tensor-parallel-size", "2"], tmp_path / "two.json")
    one_rank, _ = _bench(argv, tmp_path / "one.json")
    assert "target split over 2 ranks, draft on rank 0" in printed and "one 2-rank engine at a time" in printed
    assert (two_ranks["order"], one_rank["order"]) == ("sequential", "interleaved")
    assert [r["k"] for r in two_ranks["rows"]] == [1, 3]
    for two, one in zip(two_ranks["rows"], one_rank["rows"]):
        assert two["same_outputs"]  # float32: the target's own greedy tokens
        # The same guesses and verdicts as on one rank: the same acceptance, step for step.
        assert (two["acceptance"], two["steps"], two["steps_alone"]) == (
            one["acceptance"],
            one["steps"],
            one["steps_alone"],
        )
        assert 0 < two["acceptance"] <= 1 and two["steps"] < two["steps_alone"]
    assert not multiprocessing.active_children()


def test_the_chat_command_runs_on_two_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("sys.stdin", StringIO("What is 12 + 30?\n/quit\n"))
    printed = StringIO()
    with redirect_stdout(printed):
        assert cli_main(["chat", "--model", "tiny", "--dtype", "float32", "--tensor-parallel-size", "2"]) == 0
    assert "chatting with tiny" in printed.getvalue() and "42" in printed.getvalue()
    assert not multiprocessing.active_children()  # leaving the chat closed the engine


@pytest.mark.parametrize(
    "command",
    ["generate", "chat", "serve", "bench offline", "bench prefix-cache", "bench speculative"],
)
def test_every_command_that_builds_an_engine_takes_the_flag(command: str) -> None:
    args = build_parser().parse_args([*command.split(), "--tensor-parallel-size", "2"])
    assert args.tensor_parallel_size == 2
    if not command.startswith("bench"):  # flags derived from EngineConfig: what the engine is given
        assert engine_kwargs(args)["tensor_parallel_size"] == 2


def test_benchmarks_refuse_a_size_below_one() -> None:
    for bench in ("offline", "prefix-cache", "speculative"):
        with pytest.raises(SystemExit, match="--tensor-parallel-size must be a positive integer, got 0"):
            cli_main(["bench", bench, "--tensor-parallel-size", "0"])
