"""Chapter 09's exercises answered wrongly, as a student plausibly would (see scripts/wrong_answers.py)."""

WRONG_ANSWERS = {
    "top-p-interval-solution": [
        # Ignores ties: answers an interval for an n inside a group of tied tokens, which top-p never stops at.
        """
if not 1 <= n <= len(logits):
    raise ValueError(f"n must be between 1 and {len(logits)}, got {n}")
ordered = logits.softmax(dim=-1).sort(descending=True).values
mass = ordered.cumsum(dim=-1)
lo = float(mass[n - 2]) if n > 1 else 0.0
hi = float(mass[n - 1]) if n < len(ordered) else 1.0
return lo, hi
""",
        # Off by one: reads 'keep while the mass up to and including the token is below p'.
        """
if not 1 <= n <= len(logits):
    raise ValueError(f"n must be between 1 and {len(logits)}, got {n}")
ordered = logits.softmax(dim=-1).sort(descending=True).values
if n < len(ordered) and ordered[n] == ordered[n - 1]:
    return None
mass = ordered.cumsum(dim=-1)
first = int((ordered > ordered[n - 1]).sum())
lo = float(mass[first]) if first < len(ordered) else 1.0
hi = float(mass[n]) if n < len(ordered) else 1.0
return lo, hi
""",
        # Checks the tie with the token before the n-th, not the one after it.
        """
if not 1 <= n <= len(logits):
    raise ValueError(f"n must be between 1 and {len(logits)}, got {n}")
ordered = logits.softmax(dim=-1).sort(descending=True).values
if n > 1 and ordered[n - 2] == ordered[n - 1]:
    return None
mass = ordered.cumsum(dim=-1)
lo = float(mass[n - 2]) if n > 1 else 0.0
hi = float(mass[n - 1]) if n < len(ordered) else 1.0
return lo, hi
""",
        # Searches with the package's top-p instead of reasoning about the mass.
        """
if not 1 <= n <= len(logits):
    raise ValueError(f"n must be between 1 and {len(logits)}, got {n}")
ordered = logits.softmax(dim=-1).sort(descending=True).values
edges = sorted(set((ordered.cumsum(-1) - ordered).tolist() + [1.0]))
hits = [(a, b) for a, b in zip(edges, edges[1:])
        if int(torch.isfinite(apply_top_p(logits[None], torch.tensor([(a + b) / 2]))[0]).sum()) == n]
return (hits[0][0], hits[-1][1]) if hits else None
""",
    ],
    "harmless-top-k-solution": [
        # The size of the nucleus: forgets that top-p renormalises over what top-k left.
        """
ordered = (logits / temperature).softmax(dim=-1).sort(descending=True).values
before = ordered.cumsum(dim=-1) - ordered
last = max(int((before < top_p).sum()), 1) - 1
return int((ordered >= ordered[last]).sum())
""",
        # Forgets the temperature: the filters see logits / T, not the logits.
        """
ordered = logits.softmax(dim=-1).sort(descending=True).values
before = ordered.cumsum(dim=-1) - ordered
last = max(int((before < top_p).sum()), 1) - 1
first = int((ordered > ordered[last]).sum())
for k in range(first + 1, len(ordered) + 1):
    left = float(ordered[ordered >= ordered[k - 1]].sum())
    if before[first] < top_p * left:
        return k
return len(ordered)
""",
        # Takes top-k as exactly k tokens: a token tied with the k-th is not counted in what top-k keeps.
        """
ordered = (logits / temperature).softmax(dim=-1).sort(descending=True).values
before = ordered.cumsum(dim=-1) - ordered
last = max(int((before < top_p).sum()), 1) - 1
first = int((ordered > ordered[last]).sum())
for k in range(first + 1, len(ordered) + 1):
    left = float(ordered[:k].sum())
    if before[first] < top_p * left:
        return k
return len(ordered)
""",
        # Tries every k with the package's sampler distribution.
        """
without = probs_from_logits(logits[None], [SamplingParams(temperature=temperature, top_p=top_p)])[0]
for k in range(1, len(logits) + 1):
    if torch.equal(probs_from_logits(logits[None], [SamplingParams(temperature=temperature, top_k=k, top_p=top_p)])[0], without):
        return k
return len(logits)
""",
    ],
    "held-back-solution": [
        # The shortest end that starts a stop string, not the longest.
        """
for length in range(1, min(len(text), max(len(s) for s in stops) - 1) + 1):
    if any(s.startswith(text[-length:]) for s in stops):
        return length
return 0
""",
        # Only the first stop string is considered.
        """
stop = stops[0]
for length in range(min(len(text), len(stop) - 1), 0, -1):
    if stop.startswith(text[-length:]):
        return length
return 0
""",
        # Off by one: the range stops before length 1, so a single held character is missed.
        """
for length in range(min(len(text), max(len(s) for s in stops) - 1), 1, -1):
    if any(s.startswith(text[-length:]) for s in stops):
        return length
return 0
""",
        # The package's checker: the exercise asks for the rule itself.
        """
emitted, _ = StopStringChecker(stops).push(text)
return len(text) - len(emitted)
""",
    ],
}
