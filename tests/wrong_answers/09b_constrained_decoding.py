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
    "integer-range-solution": [
        # Checks the prefix's own value against the range: "1" is refused in 37..4200, though 1234 begins with it.
        """
def can_become(digits):
    if not (digits.isascii() and digits.isdigit()) or (digits[0] == "0" and len(digits) > 1):
        return False
    return lo <= int(digits) <= hi

allowed = torch.tensor([bool(piece) and can_become(text + piece) for piece in token_texts])
allowed[eos_ids] = bool(text) and can_become(text)
return allowed
""",
        # Only the upper bound: a prefix is allowed while it does not exceed hi, so "1" passes in 20..29.
        """
def can_become(digits):
    if not (digits.isascii() and digits.isdigit()) or (digits[0] == "0" and len(digits) > 1):
        return False
    return int(digits) <= hi

allowed = torch.tensor([bool(piece) and can_become(text + piece) for piece in token_texts])
allowed[eos_ids] = bool(text) and can_become(text) and lo <= int(text)
return allowed
""",
        # Forgets the zero: "0" counts as the beginning of every number from 0 to 9..9, and "07" is 7.
        """
def can_become(digits):
    if not (digits.isascii() and digits.isdigit()):
        return False
    for j in range(len(str(hi)) - len(digits) + 1):
        if int(digits) * 10**j <= hi and (int(digits) + 1) * 10**j - 1 >= lo:
            return True
    return False

allowed = torch.tensor([bool(piece) and can_become(text + piece) for piece in token_texts])
allowed[eos_ids] = can_become(text) and lo <= int(text) <= hi
return allowed
""",
        # Off by one at the top of each interval: "1" followed by one digit reaches 20, so "1" passes in 20..29.
        """
def can_become(digits):
    if not (digits.isascii() and digits.isdigit()) or (digits[0] == "0" and len(digits) > 1):
        return False
    if digits == "0":
        return lo == 0
    for j in range(len(str(hi)) - len(digits) + 1):
        if int(digits) * 10**j <= hi and (int(digits) + 1) * 10**j >= lo:
            return True
    return False

allowed = torch.tensor([bool(piece) and can_become(text + piece) for piece in token_texts])
allowed[eos_ids] = can_become(text) and lo <= int(text) <= hi
return allowed
""",
        # Pads every prefix to the length of hi: numbers shorter than hi are missed (5 in 5..10**12).
        """
def can_become(digits):
    if not (digits.isascii() and digits.isdigit()) or (digits[0] == "0" and len(digits) > 1):
        return False
    if digits == "0":
        return lo == 0
    j = len(str(hi)) - len(digits)
    return j >= 0 and int(digits) * 10**j <= hi and (int(digits) + 1) * 10**j - 1 >= lo

allowed = torch.tensor([bool(piece) and can_become(text + piece) for piece in token_texts])
allowed[eos_ids] = bool(text) and lo <= int(text) <= hi
return allowed
""",
        # The grammar engine's own mask: the exercise asks for the arithmetic that produces it.
        """
matcher = masks.matcher_for(StructuredOutputsParams(json={"type": "integer", "minimum": lo, "maximum": hi}))
matcher.consume_tokens(tokenizer.encode(text))
return package_allowed(matcher)
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
