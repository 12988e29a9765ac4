"""The engine's command-line flags, derived from ``EngineConfig`` (chapter 10).

Every ``EngineConfig`` field but ``show_progress`` becomes a flag of the same name, vLLM's
spelling (``num_kv_blocks`` -> ``--num-kv-blocks``, ``enable_prefix_caching`` ->
``--enable-prefix-caching`` / ``--no-enable-prefix-caching``), with the field's default and help.
``mini-infer generate``, ``chat`` and ``serve`` share them, so a new option reaches every
command at once.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from typing import Any

from mini_infer.engine_builder import EngineConfig

_NOT_FLAGS = ("model", "show_progress")


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """``--model`` (default: the shipped ``tiny``) and one flag per engine option."""
    parser.add_argument("--model", default="tiny", help=_field("model").metadata["help"])
    hints = typing.get_type_hints(EngineConfig)
    for f in dataclasses.fields(EngineConfig):
        if f.name in _NOT_FLAGS:
            continue
        flag, kind = "--" + f.name.replace("_", "-"), hints[f.name]
        if kind is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default, help=f.metadata["help"])
        else:
            number = next((t for t in (int, float) if t in typing.get_args(kind) or t is kind), str)
            default = "" if f.default is None else f" (default: {f.default})"
            parser.add_argument(flag, type=number, default=f.default, help=f.metadata["help"] + default)


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The engine options parsed by ``add_engine_args``, as ``EngineConfig`` keyword arguments."""
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig) if f.name not in _NOT_FLAGS}


def _field(name: str) -> dataclasses.Field[Any]:
    return next(f for f in dataclasses.fields(EngineConfig) if f.name == name)
