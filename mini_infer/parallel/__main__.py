"""``torchrun ... -m mini_infer.parallel <a mini-infer command>``: every rank started by torchrun (chapter 14).

On one machine with two GPUs::

    torchrun --nproc-per-node 2 -m mini_infer.parallel serve --model Qwen/Qwen2.5-1.5B-Instruct \\
        --tensor-parallel-size 2 --dtype float16 --enforce-eager

On two machines with one GPU each, the same command on both, with ``--nnodes 2 --node-rank 0``
(then 1), ``--rdzv-backend c10d`` and ``--rdzv-endpoint HOST:29500`` naming the first machine.
Rank 0 runs the command (its flags must include ``--tensor-parallel-size`` equal to the number of
ranks); the other ranks ignore it and wait for rank 0 to tell them what to build
(``workers.serve_torchrun_rank``). The c10d rendezvous gives the ranks out itself, ignoring
``--node-rank``: rank 0 (where a server listens) may be on either machine.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import torch
import torch.distributed as dist

from mini_infer.parallel.workers import COLLECTIVE_TIMEOUT, serve_torchrun_rank


def main(argv: Sequence[str] | None = None) -> int:
    backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, timeout=COLLECTIVE_TIMEOUT)
    try:
        if dist.get_rank() == 0:
            from mini_infer.cli import main as cli_main

            return cli_main(argv)
        serve_torchrun_rank()
        return 0
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
