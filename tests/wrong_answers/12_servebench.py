"""Chapter 12's exercises answered wrongly, as a student plausibly would (see scripts/wrong_answers.py)."""

WRONG_ANSWERS = {
    "tightest-tpot-solution": [
        # Forgets that a request without a TPOT (one token) meets any TPOT target: only TPOTs are counted.
        """
on_time = [r for r in records if r.success and r.ttft is not None and r.ttft * 1000.0 <= ttft_limit_ms]
tpots = sorted(r.tpot * 1000.0 for r in on_time if r.tpot is not None)
return tpots[needed - 1] if needed <= len(tpots) else None
""",
        # Ranks the TPOTs of every successful request, also those that missed the TTFT target.
        """
ok = [r for r in records if r.success]
always = sum(r.tpot is None and r.ttft is not None and r.ttft * 1000.0 <= ttft_limit_ms for r in ok)
tpots = sorted(r.tpot * 1000.0 for r in ok if r.tpot is not None)
more = needed - always
if more <= 0:
    return 0.0
return tpots[more - 1] if more <= len(tpots) else None
""",
        # Off by one: the limit that makes one request more good than needed.
        """
on_time = [r for r in records if r.success and r.ttft is not None and r.ttft * 1000.0 <= ttft_limit_ms]
always = sum(r.tpot is None for r in on_time)
tpots = sorted(r.tpot * 1000.0 for r in on_time if r.tpot is not None)
more = needed - always
if more <= 0:
    return 0.0
return tpots[more] if more < len(tpots) else None
""",
        # When too few requests can be good, returns the loosest TPOT seen instead of None.
        """
on_time = [r for r in records if r.success and r.ttft is not None and r.ttft * 1000.0 <= ttft_limit_ms]
always = sum(r.tpot is None for r in on_time)
tpots = sorted(r.tpot * 1000.0 for r in on_time if r.tpot is not None)
more = needed - always
if more <= 0 or not tpots:
    return 0.0
return tpots[min(more, len(tpots)) - 1]
""",
        # servebench's own goodput, tried at every candidate limit: the exercise asks which requests are good.
        """
candidates = sorted({0.0} | {r.tpot * 1000.0 for r in records if r.success and r.tpot is not None})
for limit in candidates:
    if compute_metrics(records, goodput_limits_ms={"ttft": ttft_limit_ms, "tpot": limit}).good_requests >= needed:
        return limit
return None
""",
    ],
    "little-solution": [
        # Failed requests counted as in flight too.
        """
if not records:
    return 0.0
start = min(r.send_time for r in records)
duration = max(r.end_time for r in records) - start
if duration <= 0:
    return 0.0
return sum(r.end_time - r.send_time for r in records) / duration
""",
        # The run's duration taken from the successful requests only.
        """
ok = [r for r in records if r.success]
if not ok:
    return 0.0
start = min(r.send_time for r in ok)
duration = max(r.end_time for r in ok) - start
if duration <= 0:
    return 0.0
return sum(r.end_time - r.send_time for r in ok) / duration
""",
        # No case for a run of duration 0: division by zero.
        """
start = min(r.send_time for r in records)
duration = max(r.end_time for r in records) - start
return sum(r.end_time - r.send_time for r in records if r.success) / duration
""",
        # servebench's own number: the exercise asks to measure it, not to compute it by Little's law.
        "return compute_metrics(records).mean_concurrency",
    ],
}
