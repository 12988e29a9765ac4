"""Chapter 05c's exercises answered wrongly, as a student plausibly would (see scripts/wrong_answers.py)."""

WRONG_ANSWERS = {
    "streaming-logsumexp-solution": [
        # No running maximum: exp(1e4) overflows to inf.
        """
total = 0.0
for chunk in chunks:
    total += torch.exp(chunk).sum().item()
return math.log(total) if total > 0 else -math.inf
""",
        # Keeps the maximum but never rescales the sum already gathered when it grows.
        """
m, total = -math.inf, 0.0
for chunk in chunks:
    if chunk.numel() == 0:
        continue
    m = max(m, chunk.max().item())
    total = total + torch.exp(chunk - m).sum().item()
return m + math.log(total) if total > 0 else -math.inf
""",
        # Rescales the wrong way round.
        """
m, total = -math.inf, 0.0
for chunk in chunks:
    if chunk.numel() == 0:
        continue
    m_new = max(m, chunk.max().item())
    total = total * math.exp(m_new - m) + torch.exp(chunk - m_new).sum().item() if m > -math.inf else torch.exp(chunk - m_new).sum().item()
    m = m_new
return m + math.log(total) if total > 0 else -math.inf
""",
        # Forgets to add the maximum back.
        """
m, total = -math.inf, 0.0
for chunk in chunks:
    if chunk.numel() == 0:
        continue
    m_new = max(m, chunk.max().item())
    total = total * math.exp(m - m_new) + torch.exp(chunk - m_new).sum().item()
    m = m_new
return math.log(total) if total > 0 else -math.inf
""",
        # Crashes on an empty chunk (max of nothing).
        """
m, total = -math.inf, 0.0
for chunk in chunks:
    m_new = max(m, chunk.max().item())
    total = total * math.exp(m - m_new) + torch.exp(chunk - m_new).sum().item()
    m = m_new
return m + math.log(total) if total > 0 else -math.inf
""",
    ],
    "blocks-of-split-solution": [
        # Splits the context's blocks, not the table's width: programs disagree with the kernel.
        """
blocks = -(-context_len // block_size)
per_split = -(-blocks // splits)
first = split * per_split
return range(first, max(first, min(first + per_split, blocks)))
""",
        # Rounds the share down: the last blocks of a long context are read by no split.
        """
per_split = width // splits
first = split * per_split
last = min(first + per_split, -(-context_len // block_size))
return range(first, max(first, last))
""",
        # Counts tokens, not blocks, for the context's end.
        """
per_split = -(-width // splits)
first = split * per_split
last = min(first + per_split, context_len // block_size)
return range(first, max(first, last))
""",
    ],
}
