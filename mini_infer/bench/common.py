"""What the benchmark scripts share (chapters 10 and 12).

* ``add_tensor_parallel_argument``: ``--tensor-parallel-size`` of the engine benchmarks (chapter 14),
  refused below 1 by ``tensor_parallel_size``.
* ``ComparisonSetup``: device, dtype and ranks of the scripts that time two engines against each
  other (``prefix_cache``, ``speculative``), and the description their JSON starts with.
* ``write_results``: the ``--json`` file of a script's figures.
* ``run_script``: the ``main`` of a script run as ``python -m``.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mini_infer.device import resolve_device, resolve_dtype


def add_tensor_parallel_argument(parser: argparse.ArgumentParser, help: str) -> None:
    """``--tensor-parallel-size N`` (default 1): the benchmark's engines split over N ranks (chapter 14)."""
    parser.add_argument("--tensor-parallel-size", type=int, default=1, help=help)


def tensor_parallel_size(args: argparse.Namespace) -> int:
    """``--tensor-parallel-size``, refused with the flag's name when it is not a positive integer."""
    size = args.tensor_parallel_size
    if size < 1:
        raise SystemExit(f"--tensor-parallel-size must be a positive integer, got {size}")
    return int(size)


@dataclass(frozen=True)
class ComparisonSetup:
    """Where a script that times two engines runs, from ``--device``, ``--dtype`` and
    ``--tensor-parallel-size``. On one rank both engines live in one process and are timed
    interleaved, so that a drifting machine slows both alike; a process holds one tensor-parallel
    engine, so on N > 1 ranks they run one after the other."""

    device: torch.device
    dtype: torch.dtype
    ranks: int
    threads: int  # this process's torch threads, before any engine is built

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ComparisonSetup:
        device = resolve_device(args.device)
        return cls(device, resolve_dtype(args.dtype, device), tensor_parallel_size(args), torch.get_num_threads())

    @property
    def interleaved(self) -> bool:
        return self.ranks == 1

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    def description(self, args: argparse.Namespace) -> dict[str, Any]:
        """How the comparison ran, as its JSON records it, with the script's arguments."""
        return {
            "dtype": self.dtype_name,
            "device": str(self.device),
            "threads": self.threads,
            "tensor_parallel_size": self.ranks,
            "order": "interleaved" if self.interleaved else "sequential",
            "args": {key: value for key, value in vars(args).items() if key != "func"},
        }


def write_results(path: str, results: dict[str, Any]) -> None:
    """Write a script's figures to ``path`` as indented JSON, and say so."""
    Path(path).write_text(json.dumps(results, indent=2))
    print(f"wrote {path}")


def run_script(
    prog: str,
    doc: str,
    add_arguments: Callable[[argparse.ArgumentParser], None],
    run: Callable[[argparse.Namespace], int],
    argv: Sequence[str] | None,
) -> int:
    """Parse ``argv`` with the script's options (described by its docstring's first paragraph), then ``run``."""
    parser = argparse.ArgumentParser(prog=prog, description=doc.split("\n\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))
