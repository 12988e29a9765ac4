"""Chapter 07's exercises answered wrongly, as a student plausibly would (see scripts/wrong_answers.py)."""

WRONG_ANSWERS = {
    "first-token-solution": [
        # Floor division: a last chunk that is not full is not counted as a step.
        """
room = budget - num_decoding
if room <= 0:
    raise ValueError(f"{num_decoding} decodes fill the budget of {budget} tokens")
return prompt_len // room
""",
        # Forgets the decodes: the prompt is given the whole budget.
        """
if budget <= num_decoding:
    raise ValueError(f"{num_decoding} decodes fill the budget of {budget} tokens")
return -(-prompt_len // budget)
""",
        # One step too many: the first token is taken to come the step after the last chunk.
        """
room = budget - num_decoding
if room <= 0:
    raise ValueError(f"{num_decoding} decodes fill the budget of {budget} tokens")
return -(-prompt_len // room) + 1
""",
        # No check of the room left: a full budget divides by zero, an overfull one gives a negative count.
        """
room = budget - num_decoding
return -(-prompt_len // room)
""",
        # The notebook's helper runs the real Scheduler: the exercise asks for the count itself.
        "return package_steps(prompt_len, num_decoding, budget)",
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
        # The notebook's helper calls the real _make_room: the exercise asks for the rule itself.
        "return package_victims(running, requester, blocks_needed, num_free, scheduled)",
    ],
}
