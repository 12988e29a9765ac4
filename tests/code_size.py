"""Lines of code of the package, as the project counts them: no blank lines, no comments, no
docstrings. ``python -m tests.code_size`` prints every module and the core engine's total.

The core engine is everything but the server, the benchmarks, the command line (``mini-infer chat``
too), the notebook helpers, the tokenizer and chat template, where models come from and the tiny
model's corpus.
"""

from __future__ import annotations

import ast
import io
import tokenize
from pathlib import Path

import mini_infer

PACKAGE = Path(mini_infer.__file__).parent
NOT_CORE = ("server/", "bench/", "cli.py", "cli_options.py", "chat_cli.py", "__main__.py", "notebook_env.py")
NOT_CORE += ("tokenizer.py", "chat_template.py", "model_source.py", "offline_models.py", "tiny_corpus.py")
# The student track's tooling and graded tests (chapter-by-chapter course material, never run by the
# engine), and tensor parallelism's benchmark.
NOT_CORE += ("course/", "parallel/bench.py")
_LAYOUT = (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER)


def count_code_lines(source: str) -> int:
    docstrings: set[int] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
            ):
                docstrings |= set(range(first.lineno, (first.end_lineno or first.lineno) + 1))
    code: set[int] = set()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type not in _LAYOUT:
            code |= set(range(token.start[0], token.end[0] + 1))
    return len(code - docstrings)


def is_core(path: Path) -> bool:
    relative = path.relative_to(PACKAGE).as_posix()
    return not any(relative.startswith(part) or relative == part for part in NOT_CORE)


def main() -> None:
    total = 0
    for path in sorted(PACKAGE.rglob("*.py")):
        lines = count_code_lines(path.read_text())
        total += lines if is_core(path) else 0
        print(f"{'core' if is_core(path) else '    '} {lines:5d}  {path.relative_to(PACKAGE)}")
    print(f"core engine: {total} lines of code")


if __name__ == "__main__":
    main()
