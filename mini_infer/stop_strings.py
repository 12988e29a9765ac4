"""Stop strings over streamed text (chapter 06; chapter 09 shows why chunked text makes them subtle).

Text reaches a request a piece at a time, and a stop string can start in one piece and end in
a later one. ``StopStringChecker`` finds the first completed stop string and holds back text
that may be the start of one, so that a stop string is never streamed to the client.
"""

from __future__ import annotations

from collections.abc import Sequence


class StopStringChecker:
    """Finds stop strings in text that arrives in pieces, and says what is safe to emit.

    The stop is the occurrence that is completed first as text arrives (smallest end; among
    those ending together, the longest). That is what checking after every character would
    find, so the answer does not depend on how the text was chunked. Text that might be the
    start of a stop string is held back until it is resolved: a stop string is never emitted
    (unless ``include_stop_str_in_output``, and then whole, in the last chunk).
    """

    def __init__(self, stop: Sequence[str], include_stop_str_in_output: bool = False) -> None:
        if isinstance(stop, str) or any(not isinstance(s, str) or s == "" for s in stop):
            raise ValueError(f"stop must be a list of non-empty str, got {stop!r}")
        self.stop = list(stop)
        self.include_stop_str_in_output = include_stop_str_in_output
        self.stopped = False
        self.matched: str | None = None  # the stop string found (vLLM's stop_reason)
        self._held = ""

    def push(self, new_text: str) -> tuple[str, bool]:
        """Add text; return (text safe to emit now, whether a stop string was completed)."""
        if self.stopped:
            raise RuntimeError("push() after a stop string was found: the request is finished")
        text = self._held + new_text
        # Only ``text`` can hold a completed stop string: emitted text never held the start of
        # one (see below), and a stop string inside the held text alone would have been found.
        found = [(start + len(s), start) for s in self.stop if (start := text.find(s)) >= 0]
        if found:
            end, start = min(found)  # first to complete; of those ending together, the longest
            self.stopped, self.matched, self._held = True, text[start:end], ""
            return text[:end] if self.include_stop_str_in_output else text[:start], True
        held = self._longest_suffix_starting_a_stop(text)
        self._held = text[len(text) - held :] if held else ""
        return text[: len(text) - held], False

    def flush(self) -> str:
        """Release held-back text when the request ends for another reason (EOS, max_tokens)."""
        held, self._held = self._held, ""
        return held

    def _longest_suffix_starting_a_stop(self, text: str) -> int:
        # A stop string that may still complete must start inside this suffix: if it started
        # earlier, the text from its start would be a longer suffix that is a prefix of it.
        longest = min(len(text), max((len(s) for s in self.stop), default=1) - 1)
        for length in range(longest, 0, -1):
            suffix = text[-length:]
            if any(s.startswith(suffix) for s in self.stop):
                return length
        return 0
