"""Chapter 09's exercises answered wrongly, as a student plausibly would (see scripts/wrong_answers.py)."""

WRONG_ANSWERS = {
    "top-p-solution": [
        # The mass *including* the token: the token that carries the nucleus over p is dropped.
        """
if p >= 1:
    return logits.clone()
probs = logits.softmax(dim=-1)
ordered = probs.sort(descending=True).values
size = max(1, int((ordered.cumsum(dim=-1) < p).sum()))
return logits.masked_fill(probs < ordered[size - 1], -math.inf)
""",
        # The first `size` tokens of the sorted order by index: a token tied with the last one is cut.
        """
if p >= 1:
    return logits.clone()
probs = logits.softmax(dim=-1)
order = probs.argsort(descending=True)
ordered = probs[order]
size = int((ordered.cumsum(dim=-1) - ordered < p).sum())
keep = torch.zeros_like(probs, dtype=torch.bool)
keep[order[:size]] = True
return logits.masked_fill(~keep, -math.inf)
""",
        # No special case for p = 1: rounding makes the mass before a very unlikely token reach 1.
        """
probs = logits.softmax(dim=-1)
ordered = probs.sort(descending=True).values
mass_before = ordered.cumsum(dim=-1) - ordered
size = int((mass_before < p).sum())
return logits.masked_fill(probs < ordered[size - 1], -math.inf)
""",
        # The package's top-p: the exercise asks for the rule itself.
        "return apply_top_p(logits[None], torch.tensor([p]))[0]",
    ],
    "temperature-top-k-solution": [
        # Multiplies by the temperature instead of dividing.
        """
scaled = logits * temperature
kth_largest = scaled.sort(descending=True).values[min(k, len(scaled)) - 1]
return scaled.masked_fill(scaled < kth_largest, -math.inf).softmax(dim=-1)
""",
        # torch.topk keeps exactly k tokens: one tied with the k-th is dropped.
        """
scaled = logits / temperature
keep = torch.zeros_like(scaled, dtype=torch.bool)
keep[scaled.topk(min(k, len(scaled))).indices] = True
return scaled.masked_fill(~keep, -math.inf).softmax(dim=-1)
""",
        # Softmax first, then zeros for the removed tokens: what is left no longer sums to 1.
        """
scaled = logits / temperature
kth_largest = scaled.sort(descending=True).values[min(k, len(scaled)) - 1]
return scaled.softmax(dim=-1).masked_fill(scaled < kth_largest, 0.0)
""",
        # The package's sampler does it: the exercise asks for the rule itself.
        "return probs_from_logits(logits[None], [SamplingParams(temperature=temperature, top_k=k)])[0]",
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
