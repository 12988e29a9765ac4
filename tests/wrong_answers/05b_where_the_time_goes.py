"""Chapter 05b's exercises answered wrongly, as a student plausibly would (see scripts/wrong_answers.py)."""

WRONG_ANSWERS = {
    "mlp-intensity-solution": [
        # Counts the weights only: right at one row, too high once the rows' bytes matter.
        """
flops = 2 * batch * hidden * 2 * intermediate + 2 * batch * intermediate * hidden
return flops / ((hidden * 2 * intermediate + intermediate * hidden) * itemsize)
""",
        # Forgets the factor 2 of a multiply-add.
        """
flops = batch * hidden * 2 * intermediate + batch * intermediate * hidden
values = hidden * 2 * intermediate + batch * (hidden + 2 * intermediate)
values += intermediate * hidden + batch * (intermediate + hidden)
return flops / (values * itemsize)
""",
        # Forgets that gate and up are two products: hidden -> intermediate once.
        """
flops = 2 * batch * hidden * intermediate + 2 * batch * intermediate * hidden
values = hidden * intermediate + batch * (hidden + intermediate)
values += intermediate * hidden + batch * (intermediate + hidden)
return flops / (values * itemsize)
""",
        # Counts values, not bytes.
        """
flops = 2 * batch * hidden * 2 * intermediate + 2 * batch * intermediate * hidden
values = hidden * 2 * intermediate + batch * (hidden + 2 * intermediate)
values += intermediate * hidden + batch * (intermediate + hidden)
return flops / values
""",
    ],
    "compute-bound-batch-solution": [
        # Rounds down: one sequence short of the crossing.
        "return max(1, math.floor(weight_bytes * peak / (bandwidth * flops_per_token)))",
        # The ratio upside down.
        "return max(1, math.ceil(bandwidth * flops_per_token / (weight_bytes * peak)))",
        # Rounds to the nearest batch.
        "return max(1, round(weight_bytes * peak / (bandwidth * flops_per_token)))",
        # Truncates and adds one: a batch too many when the ceilings cross exactly.
        "return int(weight_bytes * peak / (bandwidth * flops_per_token)) + 1",
    ],
    "phase-to-optimise-solution": [
        # The largest phase, whatever its change buys.
        """
best = max(speedups, key=lambda phase: shares[phase])
share = shares[best]
return best, 1 / ((1 - share) + share / speedups[best])
""",
        # The largest factor, whatever the phase's share.
        """
best = max(speedups, key=lambda phase: speedups[phase])
share = shares[best]
return best, 1 / ((1 - share) + share / speedups[best])
""",
        # Takes the time a change saves as its speedup, share times factor.
        """
best = max(speedups, key=lambda phase: shares[phase] * speedups[phase])
return best, shares[best] * speedups[best]
""",
        # Right phase, but the step speeds up as much as the phase (the rest forgotten).
        """
def step_speedup(phase: str) -> float:
    share = shares[phase]
    return 1 / ((1 - share) + share / speedups[phase])

best = max(speedups, key=step_speedup)
return best, speedups[best]
""",
    ],
}
