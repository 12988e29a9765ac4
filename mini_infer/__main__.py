"""``python -m mini_infer`` is the ``mini-infer`` command (chapter 12)."""

from mini_infer.cli import main

raise SystemExit(main())
