"""Chapter 09b's exercises answered wrongly, as a student plausibly would (see scripts/wrong_answers.py)."""

WRONG_ANSWERS = {
    "unpack-bitmask-solution": [
        # Tests bit i with `word & (1 << i)` and `> 0`: in int32, 1 << 31 is negative, so token 31 of a word is lost.
        """
bits = torch.tensor([1 << i for i in range(32)], dtype=torch.int32)
return ((words.unsqueeze(-1) & bits) > 0).flatten()[:vocab_size]
""",
        # Bits read from the most significant end: token 0 is bit 31.
        """
shifts = torch.arange(31, -1, -1, dtype=torch.int32)
return (((words.unsqueeze(-1) >> shifts) & 1) == 1).flatten()[:vocab_size]
""",
        # Forgets to cut the padding of the last word: 32 entries per word.
        """
shifts = torch.arange(32, dtype=torch.int32)
return (((words.unsqueeze(-1) >> shifts) & 1) == 1).flatten()
""",
        # The package's apply_bitmask on a row of zeros: the exercise asks for the unpacking itself.
        """
logits = torch.zeros(1, vocab_size)
apply_bitmask(logits, words[None])
return torch.isfinite(logits[0])
""",
    ],
    "choice-mask-solution": [
        # Never allows the end-of-turn tokens: a finished choice can never end.
        """
return torch.tensor([bool(piece) and any(c.startswith(text + piece) for c in choices) for piece in token_texts])
""",
        # Allows the end-of-turn tokens at every step: "P" could end the answer.
        """
allowed = torch.tensor([bool(piece) and any(c.startswith(text + piece) for c in choices) for piece in token_texts])
allowed[eos_ids] = True
return allowed
""",
        # Compares the token alone with the choices' beginnings, forgetting the text already written.
        """
allowed = torch.tensor([bool(piece) and any(c.startswith(piece) for c in choices) for piece in token_texts])
allowed[eos_ids] = text in choices
return allowed
""",
        # Tokens with an empty text (special tokens) "keep the text a prefix" and are allowed too.
        """
allowed = torch.tensor([any(c.startswith(text + piece) for c in choices) for piece in token_texts])
allowed[eos_ids] = text in choices
return allowed
""",
    ],
    "forced-text-solution": [
        # `if` instead of `while`: only the first forced character.
        """
forced = ""
if regex.fullmatch(pattern, text) is None:
    options = [c for c in map(chr, range(32, 127)) if regex.fullmatch(pattern, text + c, partial=True)]
    if len(options) == 1:
        forced = options[0]
return forced
""",
        # Checks for a complete match only after appending: a text that is already a match still gets a character.
        """
forced = ""
while True:
    options = [c for c in map(chr, range(32, 127)) if regex.fullmatch(pattern, text + forced + c, partial=True)]
    if len(options) != 1:
        break
    forced += options[0]
    if regex.fullmatch(pattern, text + forced) is not None:
        break
return forced
""",
        # Only letters and digits are tried as the next character: punctuation is never forced.
        """
forced = ""
alphabet = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
while regex.fullmatch(pattern, text + forced) is None:
    options = [c for c in alphabet if regex.fullmatch(pattern, text + forced + c, partial=True)]
    if len(options) != 1:
        break
    forced += options[0]
return forced
""",
    ],
}
