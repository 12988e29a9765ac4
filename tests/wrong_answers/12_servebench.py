"""Chapter 12's exercises answered wrongly, as a student plausibly would (see scripts/wrong_answers.py)."""

WRONG_ANSWERS = {
    "tpot-itl-solution": [
        # Divides by every output token, not by the tokens after the first.
        """
itls = [b - a for a, b in zip(chunk_times, chunk_times[1:])]
if not chunk_times or output_tokens < 2:
    return None, itls
return (end_time - chunk_times[0]) / output_tokens, itls
""",
        # Ends at the last chunk instead of the end of the response.
        """
itls = [b - a for a, b in zip(chunk_times, chunk_times[1:])]
if not chunk_times or output_tokens < 2:
    return None, itls
return (chunk_times[-1] - chunk_times[0]) / (output_tokens - 1), itls
""",
        # The first "inter-token" gap measured from the send: the TTFT counted as an ITL.
        """
itls = [b - a for a, b in zip([send_time] + chunk_times, chunk_times)]
if not chunk_times or output_tokens < 2:
    return None, itls
return (end_time - chunk_times[0]) / (output_tokens - 1), itls
""",
        # servebench's own record: the exercise asks for the definitions themselves.
        """
record = RequestRecord(0, send_time, end_time, list(chunk_times), output_tokens=output_tokens)
return record.tpot, record.itls
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
