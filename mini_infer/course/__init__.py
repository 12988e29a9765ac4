"""The student track (appendix): assignments generated from the package's own source, and graders.

The functions a student writes are marked in ``mini_infer/`` itself, each between a pair of
comments (``regions``); ``student`` writes a copy of the package with those bodies replaced by
``raise NotImplementedError("chapter NN: ...")``; ``grade`` runs a chapter's graded tests
(``mini_infer/course/graded/test_chapterNN.py``) against any copy of the package in a subprocess;
``mutants`` proves those tests catch wrong answers. ``mini-infer course`` is their command line.

Nothing of the engine imports this subpackage: it reads the package's files as text.
"""
