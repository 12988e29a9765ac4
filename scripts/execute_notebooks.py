#!/usr/bin/env python
"""Re-execute the book's notebooks in place, in order, and store their outputs.

    python scripts/execute_notebooks.py                   # every notebooks/*.ipynb
    python scripts/execute_notebooks.py notebooks/03_kv_cache.ipynb
    python scripts/execute_notebooks.py --timeout 1200 --online notebooks/13_kaggle_t4.ipynb

Notebooks are committed with their outputs: GitHub, Colab, Kaggle and the website show them
without running anything. This script is how those outputs are refreshed:

* each notebook runs top to bottom in a fresh kernel of *this* Python environment (whatever
  kernel name the notebook stores), with the notebook's folder as working directory;
* ``HF_HUB_OFFLINE=1`` unless ``--online``: stored outputs come from the offline tiny model, the
  same as CI's nbval run sees;
* the first error stops everything, loudly, and leaves that notebook's file untouched;
* outputs are kept; the noise that makes diffs large is not: no execution timestamps, a fixed
  kernelspec, no Python patch version in ``language_info``.

The execution helpers here are also used by ``scripts/check_student_versions.py``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterable, Mapping
from pathlib import Path

import ipykernel.kernelspec
import nbformat
from jupyter_client.kernelspec import KernelSpec, KernelSpecManager
from jupyter_client.manager import AsyncKernelManager
from jupyter_core.utils import run_sync
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError
from nbformat import NotebookNode

from mini_infer.course.kernel_client import ShortWaitKernelClient

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS_DIR = ROOT / "notebooks"
KERNELSPEC = {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"}


class CurrentEnvKernelSpecManager(KernelSpecManager):
    """Every kernel name means "ipykernel in the Python running this script" (like nbval's
    ``--nbval-current-env``), so a kernel name stored by someone's laptop never matters."""

    def get_kernel_spec(self, kernel_name: str) -> KernelSpec:
        return self.kernel_spec_class(
            resource_dir=ipykernel.kernelspec.RESOURCES, **ipykernel.kernelspec.get_kernel_dict()
        )


def find_notebooks(paths: Iterable[str | Path] = ()) -> list[Path]:
    """The given notebooks (folders expand to their ``*.ipynb``), in book order (by file name)."""
    paths = list(paths) or [NOTEBOOKS_DIR]
    found: list[Path] = []
    for path in map(Path, paths):
        if path.is_dir():
            found.extend(p for p in sorted(path.glob("*.ipynb")) if not p.name.startswith("_"))
        elif path.suffix == ".ipynb" and path.is_file():
            found.append(path)
        else:
            raise SystemExit(f"error: {path} is neither a notebook nor a folder")
    return found


def kernel_environment(online: bool = False) -> dict[str, str]:
    env = dict(os.environ)
    if not online:
        env["HF_HUB_OFFLINE"] = "1"
    # Progress bars carry timings: noise in stored outputs.
    env.setdefault("TQDM_DISABLE", "1")
    return env


def execute(
    nb: NotebookNode,
    *,
    cwd: Path,
    timeout: int = 600,
    allow_errors: bool = False,
    env: Mapping[str, str] | None = None,
) -> NotebookNode:
    """Run every code cell of ``nb`` in a fresh current-environment kernel; outputs land in ``nb``.

    With ``allow_errors`` every cell runs even after a failure and errors are stored as outputs;
    without it the first error raises ``nbclient.exceptions.CellExecutionError``.
    """
    # IPC sockets, not TCP ports: kernels started side by side (check_student_versions runs two,
    # other processes more) cannot race for a port, and a message cannot reach the wrong kernel.
    # A lost kernel_info reply once stalled a run for the full timeout.
    # The socket files' prefix must be absolute: the kernel runs in the notebook's folder.
    sockets = Path(tempfile.mkdtemp(prefix="mini-infer-kernel-")) / "kernel"
    km = AsyncKernelManager(
        kernel_name="python3",
        kernel_spec_manager=CurrentEnvKernelSpecManager(),
        client_factory=ShortWaitKernelClient,
        transport="ipc",
        ip=str(sockets),
    )
    client = NotebookClient(
        nb,
        km=km,
        timeout=timeout,
        allow_errors=allow_errors,
        record_timing=False,
        store_widget_state=True,
        shutdown_kernel="immediate",
        resources={"metadata": {"path": str(cwd)}},
    )
    try:
        client.execute(env=dict(env if env is not None else kernel_environment()))
    finally:
        # nbclient shuts down only kernels whose manager it made itself; this one is ours. Without
        # this, every executed notebook leaves its kernel (and all it allocated) alive until the
        # script ends, and a run over all chapters runs out of memory.
        if km.has_kernel:
            run_sync(km.shutdown_kernel)(now=True)
        shutil.rmtree(sockets.parent, ignore_errors=True)
    return nb


def normalize(nb: NotebookNode) -> NotebookNode:
    """Drop what changes from machine to machine but says nothing about the notebook."""
    nb.metadata["kernelspec"] = dict(KERNELSPEC)
    language_info = nb.metadata.get("language_info")
    if language_info is not None:
        language_info.pop("version", None)
    for cell in nb.cells:
        cell.metadata.pop("execution", None)
        cell.metadata.pop("ExecuteTime", None)
    return nb


def execute_in_place(path: Path, *, timeout: int, online: bool) -> float:
    nb = nbformat.read(path, as_version=4)
    start = time.perf_counter()
    execute(nb, cwd=path.parent, timeout=timeout, env=kernel_environment(online))
    elapsed = time.perf_counter() - start
    normalize(nb)
    nbformat.validate(nb)
    nbformat.write(nb, path)
    return elapsed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="*", help="notebooks or folders (default: notebooks/)")
    parser.add_argument("--timeout", type=int, default=600, help="seconds allowed per cell (default 600)")
    parser.add_argument("--online", action="store_true", help="let notebooks reach the Hugging Face hub")
    args = parser.parse_args(argv)

    notebooks = find_notebooks(args.paths)
    if not notebooks:
        print("no notebooks found", file=sys.stderr)
        return 1
    for path in notebooks:
        shown = path.resolve().relative_to(ROOT) if path.resolve().is_relative_to(ROOT) else path
        print(f"executing {shown} ...", flush=True)
        try:
            elapsed = execute_in_place(path, timeout=args.timeout, online=args.online)
        except CellExecutionError as error:
            print(f"\nFAILED: {shown} (left unchanged)\n{error}", file=sys.stderr)
            return 1
        print(f"  ok in {elapsed:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
