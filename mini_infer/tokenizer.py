"""Tokenizer, chat template and streaming detokenization (chapter 01).

The tokenizer and its chat template come from ``transformers`` (``AutoTokenizer`` reads both
``chat_template.jinja`` and the older template inside ``tokenizer_config.json``); the model is
ours. Two things are added here:

* ``Tokenizer.apply_chat_template`` renders conversations into the prompt string the model
  was trained on, tools included; ``template_messages`` checks a conversation first and turns
  OpenAI's content parts (``[{"type": "text", "text": ...}]``) into the plain text a template reads;
* ``IncrementalDetokenizer`` turns a growing list of token ids into text pieces for streaming.
  Byte-level BPE tokens can end in the middle of a UTF-8 character (an emoji is often split
  over two or three tokens), so a piece is emitted only once it decodes to complete
  characters: the concatenation of all pieces always equals decoding all tokens at once, and
  no piece ever contains half a character (U+FFFD).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

Message = dict[str, Any]


def template_messages(conversation: object, where: str = "") -> list[Message]:
    """``conversation`` as a chat template reads it, or a ValueError saying which message is wrong
    and how (``where`` names the conversation in a list of them). Each message is a dict with a
    string ``role`` and a ``content`` that is a string, a list of OpenAI text parts (joined), or
    None in an assistant message that has ``tool_calls``; other keys are kept."""
    shape = "a list of {'role': ..., 'content': ...} dicts"
    if isinstance(conversation, (str, bytes, Mapping)) or not isinstance(conversation, Sequence):
        raise ValueError(f"{where}a conversation must be {shape}, got {type(conversation).__name__}")
    if not conversation:
        raise ValueError(f"{where}the conversation is empty: give at least one message")
    checked = []
    for i, message in enumerate(conversation):
        at = f"{where}message {i}"
        if not isinstance(message, Mapping):
            raise ValueError(f"{at} must be a dict with 'role' and 'content', got {type(message).__name__}")
        if not isinstance(message.get("role"), str):
            raise ValueError(
                f"{at} needs a 'role' string (system, user, assistant or tool), got {message.get('role')!r}"
            )
        content = message.get("content")
        if isinstance(content, list):
            kinds = {part.get("type") if isinstance(part, Mapping) else type(part).__name__ for part in content}
            if kinds - {"text"} or not all(isinstance(part.get("text"), str) for part in content):
                raise ValueError(f"{at}: content parts must be {{'type': 'text', 'text': str}}, got {content!r}")
            content = "".join(part["text"] for part in content)
        elif content is None and not (message["role"] == "assistant" and message.get("tool_calls")):
            raise ValueError(f"{at} needs 'content' (only an assistant message with tool_calls may leave it out)")
        elif content is not None and not isinstance(content, str):
            raise ValueError(f"{at}: content must be a string or a list of text parts, got {type(content).__name__}")
        checked.append({**message, "content": content})
    return checked


class Tokenizer:
    """A thin wrapper over a Hugging Face fast tokenizer with the calls the engine needs."""

    def __init__(self, model_dir: str | Path) -> None:
        from transformers import AutoTokenizer

        self.model_dir = Path(model_dir)
        self.hf = AutoTokenizer.from_pretrained(str(model_dir))
        self.eos_token_id: int | None = self.hf.eos_token_id

    def __len__(self) -> int:
        return len(self.hf)

    def encode(self, text: str) -> list[int]:
        # Qwen adds no BOS token; add_special_tokens=False keeps other tokenizers from adding one
        # to a prompt that a chat template already rendered with its own markers.
        return list(self.hf.encode(text, add_special_tokens=False))

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return str(self.hf.decode(list(token_ids), skip_special_tokens=skip_special_tokens))

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf, "chat_template", None))

    def apply_chat_template(
        self,
        messages: Sequence[Message],
        *,
        tools: Sequence[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
    ) -> str:
        if not self.has_chat_template:
            raise ValueError("this model's tokenizer has no chat template; use generate() with a plain prompt instead")
        return str(
            self.hf.apply_chat_template(
                list(messages),
                tools=list(tools) if tools else None,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
            )
        )


class IncrementalDetokenizer:
    """Decode a stream of token ids into text pieces that never split a character.

    The window technique (as in vLLM): keep ``prefix_offset`` (start of a small decoded window,
    kept for tokenizers whose decoding of a token depends on its left neighbour) and
    ``read_offset`` (tokens already turned into emitted text). Each push decodes only the
    window, so streaming costs O(tokens), not O(tokens^2).
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self.text = ""

    def push(self, new_token_ids: Sequence[int]) -> str:
        """Add tokens; return the newly complete text (possibly empty)."""
        self.token_ids.extend(new_token_ids)
        decode = self.tokenizer.decode
        prefix_text = decode(self.token_ids[self.prefix_offset : self.read_offset], self.skip_special_tokens)
        full_text = decode(self.token_ids[self.prefix_offset :], self.skip_special_tokens)
        if len(full_text) > len(prefix_text) and not full_text.endswith("\ufffd"):
            piece = full_text[len(prefix_text) :]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.token_ids)
            self.text += piece
            return piece
        return ""

    def flush(self) -> str:
        """At the end of a stream: whatever is left, incomplete characters included."""
        prefix_text = self.tokenizer.decode(
            self.token_ids[self.prefix_offset : self.read_offset], self.skip_special_tokens
        )
        full_text = self.tokenizer.decode(self.token_ids[self.prefix_offset :], self.skip_special_tokens)
        piece = full_text[len(prefix_text) :]
        self.prefix_offset = self.read_offset = len(self.token_ids)
        self.text += piece
        return piece
