"""A model's own sampling defaults (``generation_config.json``), as vLLM's ``--generation-config``:
requests that leave a field unset take the model's value, explicit values always win, and
``generation_config="vllm"`` ignores the file; for ``LLM``, the command line and the server."""

from __future__ import annotations

import argparse
import copy
import json
import pickle
import shutil
import warnings
from pathlib import Path
from typing import Any

import httpx
import pytest

from mini_infer import LLM, SamplingParams
from mini_infer.cli import build_parser, generate_params, main
from mini_infer.sampling_params import generation_defaults
from mini_infer.server import BackgroundServer, ServerConfig, build_app

# Qwen2.5-Instruct's defaults, with a penalty strong enough to change greedy tokens, and a
# max_new_tokens that shows in every output's length.
DEFAULTS: dict[str, Any] = {
    "temperature": 0.7,
    "top_p": 0.8,
    "top_k": 20,
    "repetition_penalty": 3.0,
    "max_new_tokens": 7,
}
AS_PARAMS: dict[str, Any] = {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 3.0, "max_tokens": 7}
ENGINE: dict[str, Any] = {"dtype": "float32", "num_kv_blocks": 64, "show_progress": False}
PROMPT = [5, 6, 7, 5, 6, 7, 5, 6]


def with_generation_config(source: Path, target: Path, **settings: Any) -> Path:
    """A copy of the model directory ``source`` whose generation_config.json also sets ``settings``."""
    shutil.copytree(source, target)
    path = target / "generation_config.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | settings))
    return target


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return with_generation_config(tiny_model_dir, tmp_path_factory.mktemp("defaults") / "model", **DEFAULTS)


@pytest.fixture(scope="module")
def llm(model_dir: Path) -> LLM:
    return LLM(str(model_dir), **ENGINE)


@pytest.fixture(scope="module")
def plain(model_dir: Path) -> LLM:
    return LLM(str(model_dir), generation_config="vllm", **ENGINE)


# ------------------------------------------------------------------ SamplingParams remembers what was set


def test_fields_set_are_the_callers_arguments_and_assignments() -> None:
    assert SamplingParams().fields_set == frozenset()
    assert SamplingParams(8, temperature=1.0).fields_set == {"max_tokens", "temperature"}
    params = SamplingParams(stop="x")  # normalised to a list by the constructor, still only "stop"
    params.top_k = 5
    assert params.fields_set == {"stop", "top_k"}
    twin = copy.copy(params)
    twin.min_p = 0.1  # a copy's assignments are its own
    assert params.fields_set == {"stop", "top_k"} and twin.fields_set == {"stop", "top_k", "min_p"}
    assert pickle.loads(pickle.dumps(params)).fields_set == params.fields_set
    assert SamplingParams(max_tokens=3) == SamplingParams(3)  # equality ignores how a value came


def test_with_defaults_fills_only_unset_fields() -> None:
    explicit = SamplingParams(temperature=1.0, max_tokens=5)  # 1.0 is vLLM's default, set on purpose
    merged = explicit.with_defaults(AS_PARAMS)
    assert (merged.temperature, merged.max_tokens) == (1.0, 5)
    assert (merged.top_p, merged.top_k, merged.repetition_penalty) == (0.8, 20, 3.0)
    assert merged.fields_set == {"temperature", "max_tokens"}  # still the caller's
    assert merged.with_defaults(AS_PARAMS) == merged  # applying them again changes nothing
    assert explicit.temperature == 1.0 and explicit.top_k == -1  # the caller's object is untouched
    assert SamplingParams().with_defaults({}) == SamplingParams()
    with pytest.raises(ValueError, match="unknown SamplingParams fields"):
        SamplingParams().with_defaults({"do_sample": True})
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams().with_defaults({"top_p": 0})


def test_with_defaults_keeps_the_newer_fields_and_names_a_clash() -> None:
    from mini_infer.sampling_params import StructuredOutputsParams

    grammar = StructuredOutputsParams(choice=["yes", "no"])
    asked = SamplingParams(logit_bias={5: 2.0}, skip_special_tokens=False, structured_outputs=grammar)
    merged = asked.with_defaults(AS_PARAMS)
    assert (merged.logit_bias, merged.skip_special_tokens, merged.structured_outputs) == ({5: 2.0}, False, grammar)
    assert (merged.temperature, merged.max_tokens) == (0.7, 7)
    # A request's min_tokens above the model's max_new_tokens: the error says the default caused it.
    with pytest.raises(ValueError, match=r"min_tokens must be <= max_tokens \(7\).*defaults .*max_tokens"):
        SamplingParams(min_tokens=10).with_defaults(AS_PARAMS)
    assert SamplingParams(min_tokens=10, max_tokens=12).with_defaults(AS_PARAMS).min_tokens == 10


# ------------------------------------------------------------------ reading generation_config.json


def test_generation_defaults_reads_what_vllm_reads(tiny_model_dir: Path, tmp_path: Path) -> None:
    assert generation_defaults(tiny_model_dir) == {}  # EOS ids and do_sample only
    assert generation_defaults(tmp_path) == {}  # no file at all
    target = with_generation_config(tiny_model_dir, tmp_path / "m", **DEFAULTS, min_p=0.05, do_sample=False)
    assert generation_defaults(target) == AS_PARAMS | {"min_p": 0.05}  # do_sample is not a default
    (target / "generation_config.json").write_text(json.dumps({"top_k": 0, "temperature": None}))
    assert generation_defaults(target) == {"top_k": -1}  # transformers' "no top-k"; null sets nothing
    (target / "generation_config.json").write_text(json.dumps({"temperature": -1}))
    with pytest.raises(ValueError, match="generation_config.json sets a sampling default .*temperature"):
        generation_defaults(target)
    (target / "generation_config.json").write_text("{")
    with pytest.raises(ValueError, match="not valid JSON"):
        generation_defaults(target)


# ------------------------------------------------------------------ LLM


def test_a_request_that_sets_nothing_gets_the_models_defaults(llm: LLM, plain: LLM) -> None:
    assert llm.get_default_sampling_params() == SamplingParams(**AS_PARAMS)
    assert plain.get_default_sampling_params() == SamplingParams()
    assert len(llm.generate([PROMPT], SamplingParams(ignore_eos=True), use_tqdm=False)[0].token_ids) == 7
    assert len(plain.generate([PROMPT], SamplingParams(ignore_eos=True), use_tqdm=False)[0].token_ids) == 16


def test_unset_fields_take_the_defaults_and_explicit_ones_win(llm: LLM, plain: LLM) -> None:
    def greedy(model: LLM, **params: Any) -> list[int]:
        return model.generate([PROMPT], SamplingParams(temperature=0, ignore_eos=True, **params), use_tqdm=False)[
            0
        ].token_ids

    penalised = greedy(plain, max_tokens=7, repetition_penalty=3.0)
    assert penalised != greedy(plain, max_tokens=7)  # the penalty shows in these tokens
    assert greedy(llm) == penalised  # the model's penalty and max_new_tokens, unasked
    assert greedy(llm, max_tokens=7, repetition_penalty=1.0) == greedy(plain, max_tokens=7)  # explicit 1.0 wins
    # Through the engine's own door as well (the server's path), and for assigned fields.
    params = SamplingParams(temperature=0)
    params.repetition_penalty = 1.0
    request_id = llm.engine.add_request(PROMPT, params)
    seq_params = llm.engine.outputs.requests[request_id].seq.params
    llm.engine.abort_request(request_id)
    assert (seq_params.repetition_penalty, seq_params.top_k, seq_params.max_tokens) == (1.0, 20, 7)


def test_generation_config_may_name_another_directory(tiny_model_dir: Path, model_dir: Path) -> None:
    borrowed = LLM(str(tiny_model_dir), generation_config=str(model_dir), **ENGINE)
    assert borrowed.get_default_sampling_params() == SamplingParams(**AS_PARAMS)
    with pytest.raises(ValueError, match="generation_config must be 'auto', 'vllm' or a directory"):
        LLM(str(tiny_model_dir), generation_config="model", **ENGINE)


def test_drafts_and_a_default_penalty_are_announced(tmp_path: Path) -> None:
    from mini_infer.model_source import resolve_model

    target = with_generation_config(resolve_model("tiny"), tmp_path / "tiny", repetition_penalty=1.05)
    with pytest.warns(UserWarning, match="served without drafts"):
        LLM(str(target), draft_model="tiny-draft", **ENGINE)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        LLM(str(target), draft_model="tiny-draft", generation_config="vllm", **ENGINE)


# ------------------------------------------------------------------ the command line


def cli_args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["generate", *argv])


def test_generate_flags_then_the_models_defaults_then_its_own_fallbacks(model_dir: Path, capsys: Any) -> None:
    assert generate_params(cli_args(), {}) == SamplingParams(max_tokens=64, temperature=0.0)
    assert generate_params(cli_args(), AS_PARAMS) == SamplingParams(**AS_PARAMS)
    given = generate_params(cli_args("--temperature", "1.0", "--top-k", "3", "--sampling-seed", "9"), AS_PARAMS)
    assert (given.temperature, given.top_k, given.seed, given.top_p, given.max_tokens) == (1.0, 3, 9, 0.8, 7)
    repeat = cli_args("--repetition-penalty", "1.0", "--min-p", "0.1")
    assert (generate_params(repeat, AS_PARAMS).repetition_penalty, generate_params(repeat, {}).min_p) == (1.0, 0.1)
    flags = ["generate", "--model", str(model_dir), "--dtype", "float32", "--num-kv-blocks", "32", "--json"]
    assert main(flags + ["--prompt", "hi", "--temperature", "0"]) == 0
    assert len(json.loads(capsys.readouterr().out)["token_ids"]) <= 7
    assert main(flags + ["--prompt", "hi", "--generation-config", "vllm", "--max-tokens", "9"]) == 0
    assert len(json.loads(capsys.readouterr().out)["token_ids"]) <= 9


def test_chat_takes_the_models_defaults_too(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import mini_infer.chat_cli

    seen: list[SamplingParams] = []
    monkeypatch.setattr(mini_infer.chat_cli, "run_chat", lambda llm, params, system=None: seen.append(params))
    flags = ["chat", "--model", str(model_dir), "--dtype", "float32", "--num-kv-blocks", "32"]
    assert main(flags) == main([*flags, "--generation-config", "vllm"]) == main([*flags, "--top-k", "3"]) == 0
    assert seen[0] == SamplingParams(**AS_PARAMS)
    assert seen[1] == SamplingParams(max_tokens=512, temperature=0.0)  # chat's own fallbacks
    assert (seen[2].top_k, seen[2].top_p) == (3, 0.8)
    assert main([*flags, "--top-p", "0"]) == 2  # refused before the model is loaded
    assert len(seen) == 3


# ------------------------------------------------------------------ the server


def test_the_server_gives_unset_fields_the_models_defaults(model_dir: Path, llm: LLM) -> None:
    engine = {k: v for k, v in ENGINE.items() if k != "show_progress"}
    config = ServerConfig(model=str(model_dir), served_model_name="m", engine_kwargs=engine, show_progress=False)
    with BackgroundServer(build_app(config)) as server:
        server.wait_ready(timeout=60)
        with httpx.Client(base_url=server.base_url, timeout=30) as http:

            def complete(**body: Any) -> dict[str, Any]:
                response = http.post("/v1/completions", json={"model": "m", "prompt": PROMPT, **body})
                assert response.status_code == 200, response.text
                return response.json()

            unset = complete(temperature=0, ignore_eos=True)  # max_tokens: the model's 7, not OpenAI's 16
            assert unset["usage"]["completion_tokens"] == 7
            expected = llm.generate([PROMPT], SamplingParams(temperature=0, ignore_eos=True), use_tqdm=False)[0]
            assert unset["choices"][0]["text"] == expected.text  # with the model's penalty
            explicit = complete(temperature=0, ignore_eos=True, max_tokens=3, repetition_penalty=1.0)
            assert explicit["usage"]["completion_tokens"] == 3
            want = llm.generate([PROMPT], SamplingParams(3, temperature=0, ignore_eos=True, repetition_penalty=1.0))
            assert explicit["choices"][0]["text"] == want[0].text
            # The newer fields a request sets go through; those it leaves unset still default.
            biased = complete(temperature=0, max_tokens=3, min_tokens=3, logit_bias={"9": 100})
            assert biased["usage"]["completion_tokens"] == 3
            want = llm.generate([PROMPT], SamplingParams(3, temperature=0, min_tokens=3, logit_bias={9: 100.0}))
            assert biased["choices"][0]["text"] == want[0].text
            assert biased["choices"][0]["text"] != complete(temperature=0, max_tokens=3)["choices"][0]["text"]
            chat = http.post(
                "/v1/chat/completions",
                json={"model": "m", "messages": [{"role": "user", "content": "hi"}], "ignore_eos": True},
            ).json()
            assert chat["usage"]["completion_tokens"] == 7  # not the room left in the context
