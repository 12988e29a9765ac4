"""Chapter 06's exercises answered wrongly, as a student plausibly would (see scripts/wrong_answers.py)."""

WRONG_ANSWERS = {
    "schedule-step-solution": [
        # Running sequences in arrival order: a prompt chunk takes the budget before the decodes behind it.
        """
scheduled = []
for request_id, todo in running:
    if budget == 0:
        break
    n = min(todo, budget)
    scheduled.append((request_id, n))
    budget -= n
num_running = len(running)
for request_id, prompt_len in waiting:
    if budget == 0 or num_running >= max_num_seqs:
        break
    n = min(prompt_len, budget)
    scheduled.append((request_id, n))
    budget -= n
    num_running += 1
return scheduled
""",
        # Admits new requests while budget remains, however many sequences already run (max_num_seqs ignored).
        """
scheduled = []
for prefilling in (False, True):
    for request_id, todo in running:
        if budget == 0:
            break
        if (todo > 1) != prefilling:
            continue
        n = min(todo, budget)
        scheduled.append((request_id, n))
        budget -= n
for request_id, prompt_len in waiting:
    if budget == 0:
        break
    n = min(prompt_len, budget)
    scheduled.append((request_id, n))
    budget -= n
return scheduled
""",
        # Skips a request whose whole prompt does not fit and admits the next ones (not first come, first served).
        """
scheduled = []
for prefilling in (False, True):
    for request_id, todo in running:
        if budget == 0:
            break
        if (todo > 1) != prefilling:
            continue
        n = min(todo, budget)
        scheduled.append((request_id, n))
        budget -= n
num_running = len(running)
for request_id, prompt_len in waiting:
    if num_running >= max_num_seqs:
        break
    if prompt_len > budget:
        continue
    scheduled.append((request_id, prompt_len))
    budget -= prompt_len
    num_running += 1
return scheduled
""",
        # Asks the real Scheduler (through the test's own helper) instead of deciding.
        "return real_schedule(running, waiting, budget, max_num_seqs)",
    ],
    "static-steps-solution": [
        # Total tokens over the batch size: as if every step were full.
        "return -(-sum(lengths) // batch_size)",
        # Every batch as long as the longest request of all.
        "return max(lengths) * -(-len(lengths) // batch_size)",
        # Floor instead of ceiling: the last, partial batch is never run.
        "return sum(max(lengths[i : i + batch_size]) for i in range(0, len(lengths) - batch_size + 1, batch_size))",
        # Runs the chapter's simulator instead of counting.
        'return len(simulate(lengths, batch_size, "static"))',
    ],
    "continuous-steps-solution": [
        # Round robin: request i goes to slot i % batch_size, not to the first slot that frees up.
        """
free_at = [0] * batch_size
for i, n in enumerate(lengths):
    free_at[i % batch_size] += n
return max(free_at)
""",
        # Total tokens over the batch size: as if no slot ever idled at the end.
        "return -(-sum(lengths) // batch_size)",
        # Returns the step at which the first slot becomes free, not the last.
        """
free_at = [0] * batch_size
for n in lengths:
    start = heapq.heappop(free_at)
    heapq.heappush(free_at, start + n)
return free_at[0]
""",
        # Counts the real Scheduler's steps instead of reasoning about slots.
        "return len(scheduler_trace(lengths, batch_size))",
    ],
    "keep-until-stop-solution": [
        # Checks the length before the stop token: a stop token that is also the last allowed says "length".
        """
kept = []
for token in new_tokens:
    kept.append(token)
    if num_output_tokens + len(kept) >= max_tokens:
        return kept, "length"
    if token in stop_token_ids:
        return kept, "stop"
return kept, None
""",
        # Keeps every token of the step, even those after the one that finished the request.
        """
reason = None
for i, token in enumerate(new_tokens, start=1):
    if reason is None and token in stop_token_ids:
        reason = "stop"
    elif reason is None and num_output_tokens + i >= max_tokens:
        reason = "length"
return list(new_tokens), reason
""",
        # Off by one: finishes for length only after going past max_tokens.
        """
kept = []
for token in new_tokens:
    kept.append(token)
    if token in stop_token_ids:
        return kept, "stop"
    if num_output_tokens + len(kept) > max_tokens:
        return kept, "length"
return kept, None
""",
        # Drops the stop token itself from the kept tokens.
        """
kept = []
for token in new_tokens:
    if token in stop_token_ids:
        return kept, "stop"
    kept.append(token)
    if num_output_tokens + len(kept) >= max_tokens:
        return kept, "length"
return kept, None
""",
        # Asks the real OutputProcessor (through the test's own helper).
        "return package_keeps(new_tokens, num_output_tokens, max_tokens, stop_token_ids)",
    ],
}
