"""Chapter 09b's exercises answered wrongly, as a student plausibly would (see scripts/wrong_answers.py)."""

WRONG_ANSWERS = {
    "pack-bitmask-solution": [
        # No padding: a vocabulary that is not a whole number of words cannot be viewed as words.
        """
words = (allowed.long().view(-1, 32) << torch.arange(32)).sum(dim=-1)
return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
""",
        # Bits weighed from the most significant end: token 0 becomes bit 31.
        """
bits = torch.cat([allowed.long(), allowed.new_zeros(-len(allowed) % 32, dtype=torch.long)])
words = (bits.view(-1, 32) << torch.arange(31, -1, -1)).sum(dim=-1)
return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
""",
        # Clamps a word that does not fit an int32 instead of reading its top bit as the sign.
        """
bits = torch.cat([allowed.long(), allowed.new_zeros(-len(allowed) % 32, dtype=torch.long)])
words = (bits.view(-1, 32) << torch.arange(32)).sum(dim=-1)
return words.clamp(max=2**31 - 1).to(torch.int32)
""",
        # The package's token_bitmask: the exercise asks for the packing itself.
        "return token_bitmask(allowed.nonzero().flatten().tolist(), len(allowed))",
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
