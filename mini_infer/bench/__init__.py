"""Benchmarks: scripts that print figures, never tests (chapters 06 and 12).

``offline``: the engine against Hugging Face ``generate`` and against the machine's roofline,
measured in the same run (see ../shared/BENCHMARKS.md for the method).
"""
