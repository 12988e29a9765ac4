"""Chapter 07's exercises answered wrongly, as a student plausibly would (see scripts/wrong_answers.py)."""

WRONG_ANSWERS = {
    "plan-chunks-solution": [
        # Prefill chunks first, decodes after: a long prompt takes the budget and stalls the decodes.
        """
plan = []
for name, remaining in prefilling:
    if budget == 0:
        break
    n = min(remaining, budget)
    plan.append((name, n))
    budget -= n
for name in decoding:
    if budget == 0:
        break
    plan.append((name, 1))
    budget -= 1
return plan
""",
        # No chunking: every prefilling sequence gets all its remaining tokens, over the budget.
        """
plan = []
for name in decoding:
    if budget == 0:
        break
    plan.append((name, 1))
    budget -= 1
for name, remaining in prefilling:
    if budget == 0:
        break
    plan.append((name, remaining))
    budget -= remaining
return plan
""",
        # A spent budget still lists the sequences that come after, with chunks of 0 tokens.
        """
plan = [(name, 1) for name in decoding[:budget]]
budget -= len(plan)
for name, remaining in prefilling:
    n = min(remaining, budget)
    plan.append((name, n))
    budget -= n
return plan
""",
        # The notebook's helper runs the real Scheduler: the exercise asks for the rule itself.
        "return package_plan(decoding, prefilling, budget)",
    ],
    "choose-victims-solution": [
        # The earliest arrival is preempted first instead of the latest.
        """
held = dict(running)
candidates = [name for name, _ in running if name not in scheduled]
victims = []
while num_free < blocks_needed:
    victim = candidates.pop(0)
    victims.append(victim)
    if victim == requester:
        break
    num_free += held[victim]
return victims
""",
        # Sequences already scheduled in this step are preempted too.
        """
held = dict(running)
candidates = [name for name, _ in running]
victims = []
while num_free < blocks_needed:
    victim = candidates.pop()
    victims.append(victim)
    if victim == requester:
        break
    num_free += held[victim]
return victims
""",
        # Preempting the requester does not end the search: it frees its blocks and goes on.
        """
held = dict(running)
candidates = [name for name, _ in running if name not in scheduled]
victims = []
while num_free < blocks_needed and candidates:
    victim = candidates.pop()
    victims.append(victim)
    num_free += held[victim]
return victims
""",
        # The notebook's helper calls the real _reserve: the exercise asks for the rule itself.
        "return package_victims(running, requester, blocks_needed, num_free, scheduled)",
    ],
}
