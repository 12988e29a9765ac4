"""Chapter 10's exercises answered wrongly, as a student plausibly would (see scripts/wrong_answers.py)."""

WRONG_ANSWERS = {
    "expected-tokens-solution": [
        # The closed form alone: at a = 1 it divides by zero.
        "return (1 - a ** (k + 1)) / (1 - a)",
        # Off by one in the exponent: the bonus token after k kept guesses is lost.
        """
if a >= 1:
    return float(k)
return (1 - a**k) / (1 - a)
""",
        # Every guess counted on its own, as if a rejection did not end the pass.
        "return 1 + k * a",
        # The chapter's simulation: the exercise asks for the exact value.
        "return simulated_tokens_per_pass(a, k)",
    ],
    "step-verdict-solution": [
        # Keeps every accepted guess, even after a rejected one.
        """
verdicts = []
for rows, guesses in zip(rows_of, drafts):
    if not rows:
        verdicts.append(([], 0))
        continue
    tokens = row_tokens[rows.start : rows.stop]
    ok = [g == t if accepted is None else accepted[rows.start + i] for i, (g, t) in enumerate(zip(guesses, tokens))]
    kept = [g for g, good in zip(guesses, ok) if good]
    verdicts.append((kept + [tokens[len(kept)]], int(bool(guesses) and all(ok))))
return verdicts
""",
        # Reads `accepted` from 0 for every input instead of from the input's first row.
        """
verdicts = []
for rows, guesses in zip(rows_of, drafts):
    if not rows:
        verdicts.append(([], 0))
        continue
    tokens = row_tokens[rows.start : rows.stop]
    n = 0
    while n < len(guesses) and (guesses[n] == tokens[n] if accepted is None else accepted[n]):
        n += 1
    verdicts.append((list(guesses[:n]) + [tokens[n]], int(bool(guesses) and n == len(guesses))))
return verdicts
""",
        # A draft lag of 1 for every input with guesses, kept or not.
        """
verdicts = []
for rows, guesses in zip(rows_of, drafts):
    if not rows:
        verdicts.append(([], 0))
        continue
    tokens = row_tokens[rows.start : rows.stop]
    n = 0
    while n < len(guesses) and (guesses[n] == tokens[n] if accepted is None else accepted[rows.start + n]):
        n += 1
    verdicts.append((list(guesses[:n]) + [tokens[n]], int(bool(guesses))))
return verdicts
""",
        # The package's accepted_prefix: the exercise asks for the bookkeeping itself.
        """
verdicts = []
for rows, guesses in zip(rows_of, drafts):
    if not rows:
        verdicts.append(([], 0))
        continue
    verdict = None if accepted is None else accepted[rows.start : rows.stop]
    kept = accepted_prefix(row_tokens[rows.start : rows.stop], guesses, verdict)
    verdicts.append((kept, int(bool(guesses) and len(kept) == len(guesses) + 1)))
return verdicts
""",
    ],
    "residual-solution": [
        # max(0, p - q) without renormalising: not a distribution.
        "return (p - q).clamp_min(0)",
        # Arguments swapped: max(0, q - p), where the draft is over-confident instead of the target.
        """
r = (q - p).clamp_min(0)
total = r.sum()
return p.clone() if total <= 0 else r / total
""",
        # No case for p == q: 0 / 0 gives NaN.
        """
r = (p - q).clamp_min(0)
return r / r.sum()
""",
        # |p - q| renormalised: the tokens the draft over-proposes get mass too.
        """
r = (p - q).abs()
total = r.sum()
return p.clone() if total <= 0 else r / total
""",
    ],
    "tokens-per-pass-solution": [
        # Adds the acceptance rates: a rejected guess does not stop the ones after it.
        "return 1.0 + float(torch.minimum(p_rows, q_rows).sum())",
        # Exercise 10.1's formula with the mean acceptance rate: the order of the guesses is lost.
        """
if len(p_rows) == 0:
    return 1.0
a = float(torch.minimum(p_rows, q_rows).sum(dim=-1).mean())
return sum(a**i for i in range(len(p_rows) + 1))
""",
        # Acceptance as the chance that a draw from q equals a draw from p (sum of p * q).
        """
kept = (p_rows * q_rows).sum(dim=-1)
return 1.0 + float(torch.cumprod(kept.double(), dim=0).sum())
""",
        # Forgets the target's own token: only the guesses kept.
        """
kept = torch.minimum(p_rows, q_rows).sum(dim=-1)
return float(torch.cumprod(kept.double(), dim=0).sum())
""",
    ],
}
