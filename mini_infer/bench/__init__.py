"""Benchmarks: scripts that print figures, never tests (chapter 12; chapters 06, 08 and 10 use them).

These machines are shared and noisy, so a figure means something only beside another taken in the
same run: every benchmark reports ratios (the engine against a baseline, against the roofline)
of medians over several repetitions. ``offline``: the engine against Hugging Face ``generate``
and against the machine's roofline; ``prefix_cache``: what the radix cache saves;
``speculative``: a draft's acceptance against its speedup; ``serve``: servebench. ``common`` holds
what the scripts share.
"""
