"""Prompts for the serving benchmark (chapter 12): random, shared-prefix and JSON lines.

* ``random``: input and output lengths drawn uniformly from [len (1 - r), len (1 + r)] (the
  ``--range-ratio`` r, as in vLLM's benchmark), prompts made of random common English words.
  With a tokenizer the prompt is trimmed until it encodes to exactly the drawn length; without
  one a word stands for a token, which is close for English words in a large BPE vocabulary.
* ``shared-prefix``: ``num_groups`` groups of ``prompts_per_group`` prompts; every prompt of a
  group starts with the same long system prompt and ends with its own question (SGLang's
  generated-shared-prefix workload). This is the workload where a prefix cache pays.
* ``jsonl``: one JSON object per line with ``prompt`` (a string) or ``messages`` (a chat), and
  an optional ``output_len``.

Invariants, kept by the tests: the same seed gives the same prompts; different prompts of the
random dataset differ from their first words (so a prefix cache finds nothing to share
between them); every prompt of a shared-prefix group starts with its group's system prompt.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

# Common short English words: nearly all are a single token (with their leading space) in the
# vocabularies of Qwen, Llama and GPT tokenizers, so without a tokenizer one word ~ one token.
WORDS = """
the of and to in is was for on that with as by at from his it an were are which this be or
had has not but have one their they its all new first two after more other time who also
been year would there when can into only over most some made may out up so school about such
many city he she we you them then than under during between three years these world while
part used before both where state through home her being work people film book music game
team group water life day house war name number line left right back end place way side land
area song age point form house body light power market family car road land field case week
month study line house color room stone plan tree river table voice story cause rain fire
sky door paper dog cat fish bird horse garden bread milk salt sugar tea coffee wine glass
cup plate chair bed window wall floor roof street town village country island ocean sea lake
hill mountain forest valley desert farm bridge station train ship plane bus ticket money bank
shop price store letter word page sound song piano drum picture camera movie radio phone
clock watch hour minute morning evening night summer winter spring autumn north south east
west red blue green yellow black white brown small large long short high low old young good
bad hot cold warm soft hard fast slow early late happy quiet loud clean dark bright open
""".split()
WORDS = list(dict.fromkeys(WORDS))  # the list above repeats a few words; keep each once


class TextTokenizer(Protocol):
    """What the datasets and the client need from a tokenizer (``mini_infer.tokenizer.Tokenizer``)."""

    def encode(self, text: str) -> list[int]: ...

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


@dataclass(slots=True)
class BenchRequest:
    """One prompt to send: text for ``/v1/completions``, messages for ``/v1/chat/completions``."""

    prompt: str | None  # None for a chat-only jsonl row
    messages: list[dict[str, Any]] | None  # None: the chat endpoint sends ``prompt`` as one user turn
    prompt_len: int | None  # tokens, when a tokenizer counted them
    output_len: int | None  # None: let the server decide (a jsonl row without output_len)
    group: int | None = None  # the shared-prefix group

    def chat_messages(self) -> list[dict[str, Any]]:
        if self.messages is not None:
            return self.messages
        return [{"role": "user", "content": self.prompt or ""}]


def uniform_lengths(rng: random.Random, n: int, length: int, range_ratio: float) -> list[int]:
    """n lengths uniform (inclusive) in [length (1 - r), length (1 + r)], never below 1."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"--range-ratio must be in [0, 1), got {range_ratio}")
    low = max(1, int(length * (1 - range_ratio)))
    high = max(low, int(length * (1 + range_ratio)))
    return [rng.randint(low, high) for _ in range(n)]


def random_text(rng: random.Random, num_tokens: int, tokenizer: TextTokenizer | None) -> tuple[str, int | None]:
    """Random words that encode to ``num_tokens`` tokens; returns the text and its token count.

    Without a tokenizer the count is unknown (None) and one word stands for one token. With
    one, ids are cut to the target and decoded; decoding then encoding again can merge or
    split tokens at the cut, so the cut is adjusted a few times until the count is exact (or,
    rarely, within a token or two of it).
    """
    words = " ".join(rng.choice(WORDS) for _ in range(num_tokens))
    if tokenizer is None:
        return words, None
    ids = tokenizer.encode(words)
    for _ in range(8):  # a few more words at most: most words are one token or two
        if len(ids) >= num_tokens:
            break
        ids += tokenizer.encode(" " + " ".join(rng.choice(WORDS) for _ in range(num_tokens - len(ids))))
    cut = num_tokens
    text = tokenizer.decode(ids[:cut])
    count = len(tokenizer.encode(text))
    for _ in range(8):
        if count == num_tokens:
            break
        cut = max(1, min(len(ids), cut + num_tokens - count))
        text = tokenizer.decode(ids[:cut])
        count = len(tokenizer.encode(text))
    return text, count


def random_dataset(
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float = 0.0,
    seed: int = 0,
    tokenizer: TextTokenizer | None = None,
) -> list[BenchRequest]:
    """``num_prompts`` random prompts of about ``input_len`` tokens asking for ``output_len`` tokens
    each, both lengths uniform within ``range_ratio`` of their value (vLLM's random dataset)."""
    rng = random.Random(seed)
    input_lens = uniform_lengths(rng, num_prompts, input_len, range_ratio)
    output_lens = uniform_lengths(rng, num_prompts, output_len, range_ratio)
    requests = []
    for n_in, n_out in zip(input_lens, output_lens):
        text, count = random_text(rng, n_in, tokenizer)
        requests.append(BenchRequest(prompt=text, messages=None, prompt_len=count, output_len=n_out))
    return requests


def shared_prefix_dataset(
    num_groups: int,
    prompts_per_group: int,
    system_prompt_len: int,
    question_len: int,
    output_len: int,
    seed: int = 0,
    tokenizer: TextTokenizer | None = None,
) -> list[BenchRequest]:
    """Groups of prompts sharing a system prompt, shuffled so that groups interleave in time.

    Interleaving is what a real server sees (many users of a few applications at once), and it
    makes the cache hold several prefixes at the same time rather than one after another.
    """
    rng = random.Random(seed)
    requests = []
    for group in range(num_groups):
        system, system_len = random_text(rng, system_prompt_len, tokenizer)
        for _ in range(prompts_per_group):
            question, question_len_tokens = random_text(rng, question_len, tokenizer)
            # For /v1/completions the prefix is the system text and a blank line; the chat
            # endpoint puts it in a system turn, which the chat template renders first.
            prompt = f"{system}\n\n{question}"
            known = system_len is not None and question_len_tokens is not None
            requests.append(
                BenchRequest(
                    prompt=prompt,
                    messages=[{"role": "system", "content": system}, {"role": "user", "content": question}],
                    prompt_len=len(tokenizer.encode(prompt)) if known and tokenizer is not None else None,
                    output_len=output_len,
                    group=group,
                )
            )
    rng.shuffle(requests)
    return requests


def jsonl_dataset(
    path: str | Path, default_output_len: int | None, tokenizer: TextTokenizer | None = None
) -> list[BenchRequest]:
    """Rows of ``{"prompt": ..., "output_len": ...}`` or ``{"messages": [...], ...}``, in file order."""
    requests = []
    with open(path, encoding="utf-8") as f:
        for line_number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{line_number}: not JSON ({e})") from None
            if not isinstance(row, dict) or ("prompt" not in row and "messages" not in row):
                raise ValueError(f"{path}:{line_number}: expected an object with 'prompt' or 'messages'")
            prompt = row.get("prompt")
            messages = row.get("messages")
            if prompt is not None and not isinstance(prompt, str):
                raise ValueError(f"{path}:{line_number}: 'prompt' must be a string")
            if messages is not None and not isinstance(messages, list):
                raise ValueError(f"{path}:{line_number}: 'messages' must be a list of chat turns")
            output_len = row.get("output_len", default_output_len)
            if output_len is not None and (not isinstance(output_len, int) or output_len < 1):
                raise ValueError(f"{path}:{line_number}: 'output_len' must be a positive integer")
            prompt_len = len(tokenizer.encode(prompt)) if tokenizer is not None and prompt is not None else None
            requests.append(
                BenchRequest(prompt=prompt, messages=messages, prompt_len=prompt_len, output_len=output_len)
            )
    if not requests:
        raise ValueError(f"{path}: no prompts")
    return requests
