"""The command line, end to end on small random models (no timing is asserted anywhere)."""

import json

import pytest

from mini_infer.cli import main


def test_generate_prints_json(tiny_model_dir, capsys):
    code = main(
        [
            "generate",
            "--model",
            str(tiny_model_dir),
            "--dtype",
            "float32",
            "--prompt",
            "hello",
            "--prompt",
            "world",
            "--max-tokens",
            "5",
            "--json",
            "--num-kv-blocks",
            "32",
        ]
    )
    assert code == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line["prompt"] for line in lines] == ["hello", "world"]
    assert all(len(line["token_ids"]) <= 5 and line["finish_reason"] in ("stop", "length") for line in lines)


def test_generate_reports_bad_input_without_traceback(tiny_model_dir, capsys):
    code = main(["generate", "--model", str(tiny_model_dir), "--prompt", "x", "--max-tokens", "0"])
    assert code == 2
    assert "max_tokens" in capsys.readouterr().err


def test_missing_model_is_a_clear_error(tmp_path, capsys):
    assert main(["generate", "--model", str(tmp_path / "nope")]) == 2
    assert "neither an existing directory" in capsys.readouterr().err


def test_random_model_command(tmp_path, capsys):
    assert main(["random-model", str(tmp_path / "m"), "--shape", "tiny-test", "--dtype", "float32"]) == 0
    assert (tmp_path / "m" / "config.json").is_file()


def test_random_model_unknown_shape_names_the_choices(tmp_path, capsys):
    assert main(["random-model", str(tmp_path / "m"), "--shape", "qwen9"]) == 2
    err = capsys.readouterr().err
    assert "'qwen9'" in err and "qwen2.5-0.5b" in err and "bench-small" in err
    assert not (tmp_path / "m").exists()


def test_bench_offline_smoke(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "bench.json"
    code = main(
        [
            "bench",
            "offline",
            "--model",
            str(tiny_model_dir),
            "--dtype",
            "float32",
            "--num-prompts",
            "3",
            "--input-len",
            "4",
            "8",
            "--output-len",
            "3",
            "--decode-len",
            "3",
            "--prefill-len",
            "16",
            "--json",
            str(out),
        ]
    )
    assert code == 0
    results = json.loads(out.read_text())
    assert results["throughput"]["output_tokens"] == 9
    assert results["throughput"]["fraction_of_roofline"] > 0
    # Read before the one timed run and after it; the fastest reading gives the lowest fraction.
    assert len(results["roofline"]["readings"]) == 2
    assert (
        0
        < results["throughput"]["fraction_of_fastest_roofline_reading"]
        <= results["throughput"]["fraction_of_roofline"]
    )
    assert results["throughput"]["speedup_vs_hf"] > 0 and results["decode"]["hf_tok_s"] > 0


def test_bench_speculative_on_the_tiny_pair(tmp_path, capsys):
    out = tmp_path / "spec.json"
    code = main(
        f"bench speculative --k 1,3 --num-prompts 4 --max-tokens 12 --repeats 1 --dtype float32 --json {out}".split()
    )
    assert code == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["k"] for r in rows] == [1, 3]
    for r in rows:
        assert r["same_outputs"]  # float32: the target's own greedy tokens
        assert 0 < r["acceptance"] <= 1 and r["steps"] < r["steps_alone"]
    assert "acceptance" in capsys.readouterr().out


def test_bench_speculative_reads_a_prompts_file_and_refuses_bad_k(tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("What is 2 + 3?\n\nSpell cat\n")
    out = tmp_path / "spec.json"
    command = (
        f"bench speculative --k 2 --prompts-file {prompts} --max-tokens 8 --repeats 1 --dtype float32 --json {out}"
    )
    code = main(command.split())
    assert code == 0
    assert json.loads(out.read_text())["rows"][0]["same_outputs"]
    assert "workload: 2 chat questions" in capsys.readouterr().out
    for bad in ("0", "two"):
        with pytest.raises(SystemExit, match="--k"):
            main(["bench", "speculative", "--k", bad])


def test_every_engine_option_is_a_flag_of_its_own_name():
    """The flags are derived from EngineConfig: a new option reaches every command at once."""
    import argparse
    import dataclasses

    from mini_infer.cli_options import add_engine_args, engine_kwargs
    from mini_infer.engine_builder import EngineConfig

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    defaults = engine_kwargs(parser.parse_args([]))
    fields = {f.name: f.default for f in dataclasses.fields(EngineConfig) if f.name not in ("model", "show_progress")}
    assert defaults == fields
    args = parser.parse_args(
        ["--no-enable-prefix-caching", "--num-kv-blocks", "7", "--gpu-memory-utilization", "0.5", "--dtype", "bf16"]
    )
    got = engine_kwargs(args)
    assert got["enable_prefix_caching"] is False and got["num_kv_blocks"] == 7
    assert got["gpu_memory_utilization"] == 0.5 and got["dtype"] == "bf16"
    with pytest.raises(SystemExit):
        parser.parse_args(["--num-kv-blocks", "many"])


def test_serve_and_generate_share_the_engine_flags(tiny_model_dir, capsys):
    code = main(
        ["generate", "--model", str(tiny_model_dir), "--dtype", "float32", "--prompt", "hi", "--max-tokens", "2"]
        + ["--num-kv-blocks", "16", "--no-enable-prefix-caching", "--max-num-seqs", "2", "--json"]
    )
    assert code == 0 and json.loads(capsys.readouterr().out)["prompt"] == "hi"
    from mini_infer.cli import build_parser

    serve = build_parser().parse_args(["serve", "--no-enable-prefix-caching", "--num-kv-blocks", "16"])
    assert serve.enable_prefix_caching is False and serve.num_kv_blocks == 16
