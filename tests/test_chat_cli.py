"""``mini-infer chat``: an interactive, streamed, multi-turn chat, driven through a pseudo-terminal
as a person would use it, and its conversation handling on its own."""

import os
import sys

import pexpect
import pytest

from mini_infer import LLM, SamplingParams
from mini_infer.chat_cli import PROMPT, run_chat


def test_a_terminal_chat_with_the_tiny_model():
    env = dict(os.environ, HF_HUB_OFFLINE="1", MINI_INFER_DEVICE="cpu", TOKENIZERS_PARALLELISM="false")
    command = [sys.executable, "-m", "mini_infer", "chat", "--model", "tiny", "--dtype", "float32"]
    chat = pexpect.spawn(command[0], command[1:], env=env, encoding="utf-8", timeout=120)
    try:
        chat.expect("chatting with tiny")
        chat.expect_exact(PROMPT)
        chat.sendline("What is 12 + 30?")
        chat.expect("42")  # streamed as it is produced
        chat.expect_exact(PROMPT)
        chat.sendline("/nonsense")
        chat.expect("unknown command /nonsense")
        chat.expect_exact(PROMPT)
        chat.sendline("/reset")
        chat.expect("forgotten")
        chat.expect_exact(PROMPT)
        chat.sendline("What is the capital of France?")
        chat.expect("Paris")
        chat.expect_exact(PROMPT)
        chat.sendintr()  # Ctrl-C at the prompt keeps the chat going
        chat.expect("/quit or Ctrl-D to leave")
        chat.expect_exact(PROMPT)
        chat.sendline("/quit")
        chat.expect(pexpect.EOF)
    finally:
        chat.close()
    assert chat.exitstatus == 0


def test_end_of_input_leaves_too():
    env = dict(os.environ, HF_HUB_OFFLINE="1", MINI_INFER_DEVICE="cpu", TOKENIZERS_PARALLELISM="false")
    chat = pexpect.spawn(
        sys.executable, ["-m", "mini_infer", "chat", "--model", "tiny"], env=env, encoding="utf-8", timeout=120
    )
    chat.expect_exact(PROMPT)
    chat.sendeof()
    chat.expect(pexpect.EOF)
    chat.close()
    assert chat.exitstatus == 0


@pytest.fixture(scope="module")
def tiny():
    return LLM("tiny", dtype="float32", show_progress=False)


def test_every_turn_sends_the_whole_conversation_and_reset_forgets_it(tiny):
    written: list[str] = []
    params = SamplingParams(max_tokens=32, temperature=0.0)

    def chat(*lines: str, system: str | None = None) -> list:
        replies = iter(lines)
        return run_chat(tiny, params, system=system, read=lambda prompt: next(replies), write=written.append)

    history = chat("What is 12 + 30?", "What is the capital of France?", "/quit")
    assert [m["role"] for m in history] == ["user", "assistant", "user", "assistant"]
    assert history[1]["content"] == "12 + 30 = 42." and "Paris" in history[3]["content"]
    # The second turn's prompt held the first turn: the prefix cache served it.
    assert tiny.stats()["prefix_cache_hit_tokens"] > 0
    # After /reset only the system prompt and the last exchange remain.
    history = chat("What is 12 + 30?", "/reset", "Spell cat", "/quit", system="Be brief.")
    assert [m["role"] for m in history] == ["system", "user", "assistant"]
    assert history[1]["content"] == "Spell cat" and history[2]["content"]
    assert "forgotten" in "".join(written)
