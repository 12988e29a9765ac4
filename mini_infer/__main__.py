"""``python -m mini_infer`` is the ``mini-infer`` command."""

from mini_infer.cli import main

raise SystemExit(main())
