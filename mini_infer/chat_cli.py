"""``mini-infer chat``: an interactive, streamed, multi-turn chat in the terminal (chapter 10).

    mini-infer chat --model tiny
    mini-infer chat --model Qwen/Qwen2.5-1.5B-Instruct --draft-model Qwen/Qwen2.5-0.5B-Instruct

Each line typed is a user turn. The reply streams as the engine produces it (``LLM.stream``), and
every turn sends the whole conversation through the model's chat template again: the prefix
cache (chapter 08) finds the turns already computed, so only the new ones cost prefill.
Commands: ``/reset`` forgets the conversation, ``/help`` lists the commands, ``/quit`` (or
Ctrl-D) leaves. Ctrl-C stops a reply: the request is aborted (its blocks freed) and what was
streamed so far stays in the conversation.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

from mini_infer.llm import LLM
from mini_infer.sampling_params import SamplingParams
from mini_infer.tokenizer import Message

PROMPT = ">>> "
HELP = "/reset forgets the conversation, /help shows this, /quit (or Ctrl-D) leaves; Ctrl-C stops a reply"


def run_chat(
    llm: LLM,
    params: SamplingParams,
    *,
    system: str | None = None,
    read: Callable[[str], str] = input,
    write: Callable[[str], object] | None = None,
) -> list[Message]:
    """Chat until ``/quit`` or end of input; returns the conversation. ``read`` and ``write`` are
    the terminal's (``input``, and writing to standard output at once), replaceable for tests."""
    write = write or _write
    start: list[Message] = [] if system is None else [{"role": "system", "content": system}]
    history = list(start)
    write(f"chatting with {llm.engine.tokenizer.model_dir.name} on {llm.engine.runner.device}. {HELP}\n")
    while True:
        try:
            line = read(PROMPT).strip()
        except EOFError:
            write("\n")
            return history
        except KeyboardInterrupt:  # at the prompt, Ctrl-C does not leave (as ollama run)
            write("\n(/quit or Ctrl-D to leave)\n")
            continue
        if line in ("/quit", "/exit"):
            return history
        if line == "/reset":
            history = list(start)
            write("(the conversation is forgotten)\n")
            continue
        if line == "/help" or line.startswith("/"):
            write(("" if line == "/help" else f"unknown command {line}. ") + HELP + "\n")
            continue
        if not line:
            continue
        history.append({"role": "user", "content": line})
        prompt = llm.engine.tokenizer.apply_chat_template(history)
        reply = ""
        try:
            for output in llm.stream(prompt, params):
                write(output.new_text)
                reply += output.new_text
        except KeyboardInterrupt:  # the stream's close aborts the request
            write(" [stopped]")
        write("\n")
        history.append({"role": "assistant", "content": reply})


def _write(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()  # a token shows the moment it is produced
