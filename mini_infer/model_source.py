"""Where a model comes from: a short name, a local directory or a Hugging Face hub id (chapter 01).

``resolve_model(name)`` returns a local directory in Hugging Face layout:

1. A short name of a model shipped inside the package (``tiny``, ``tiny-draft``: the small
   trained pair from the appendix chapter), so that everything works offline.
2. An existing local directory, used as it is.
3. Otherwise a hub id such as ``Qwen/Qwen2.5-0.5B-Instruct``: taken from the local Hugging Face
   cache when it is there, else downloaded with ``huggingface_hub`` (only the files the engine
   reads). When the hub cannot be reached the error says so and how to pass a directory.

On Kaggle, a model attached to a notebook is mounted read-only under ``/kaggle/input``:
``find_kaggle_model("qwen-lm/qwen2.5/transformers/0.5b-instruct")`` finds its directory, to pass
as a local one (chapter 13 runs Qwen2.5 that way).
"""

from __future__ import annotations

from pathlib import Path

PACKAGE_MODELS_DIR = Path(__file__).resolve().parent / "models"
KAGGLE_INPUT = Path("/kaggle/input")
SHIPPED_MODELS = {"tiny": "tiny", "tiny-draft": "tiny-draft"}

# Everything mini-infer reads from a checkpoint; nothing else is downloaded.
_ALLOW_PATTERNS = [
    "config.json",
    "generation_config.json",
    "*.safetensors",
    "model.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
]


class ModelNotFoundError(FileNotFoundError):
    """The model could be neither found locally nor downloaded; the message says what to do."""


def resolve_model(model: str | Path) -> Path:
    """Return the local directory that holds ``model`` (see the module docstring)."""
    name = str(model)
    if name in SHIPPED_MODELS:
        path = PACKAGE_MODELS_DIR / SHIPPED_MODELS[name]
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(
                f"the shipped model {name!r} is missing from {path}; reinstall mini-infer or "
                "rebuild it with scripts/train_tiny_pair.py"
            )
        return path
    path = Path(name).expanduser()
    if path.exists():
        if not path.is_dir():
            raise ModelNotFoundError(f"{path} is a file; pass the directory that holds config.json")
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(f"{path} has no config.json: it is not a Hugging Face model directory")
        return path
    if not _looks_like_hub_id(name):
        raise ModelNotFoundError(
            f"{name!r} is neither an existing directory, a shipped model ({', '.join(SHIPPED_MODELS)}) "
            "nor a hub id of the form 'organisation/model'"
        )
    return _download(name)


def _looks_like_hub_id(name: str) -> bool:
    parts = name.split("/")
    return len(parts) == 2 and all(parts) and not name.startswith((".", "~"))


def _download(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download

    try:
        # The cache first: no network needed when the model was downloaded before.
        return Path(snapshot_download(repo_id, allow_patterns=_ALLOW_PATTERNS, local_files_only=True))
    except Exception:
        pass
    try:
        return Path(snapshot_download(repo_id, allow_patterns=_ALLOW_PATTERNS))
    except Exception as exc:  # huggingface_hub raises several types for "offline"
        raise ModelNotFoundError(
            f"could not download {repo_id!r} from the Hugging Face Hub ({type(exc).__name__}: {exc}). "
            "The hub may be unreachable from this machine. Download the model elsewhere "
            f"(`huggingface-cli download {repo_id} --local-dir DIR`) and pass that directory, "
            "or use the offline model 'tiny'."
        ) from exc


def find_kaggle_model(handle: str, root: str | Path = KAGGLE_INPUT) -> Path | None:
    """The directory holding ``config.json`` of the Kaggle model ``handle``
    (``owner/model/framework/variation``, optionally ``/version``) where a Kaggle notebook mounts
    it, or None when it is not attached. Both layouts in use are searched:
    ``<root>/models/<owner>/<model>/<framework>/<variation>/<version>`` and the older
    ``<root>/<model>/<framework>/<variation>/<version>``; names match without regard to case; the
    files may sit in the version's folder or in its only subfolder; without a version in the
    handle, the highest one mounted is taken."""
    parts = handle.strip("/").split("/")
    if len(parts) not in (4, 5) or not all(parts):
        raise ValueError(f"a Kaggle model handle is owner/model/framework/variation[/version], got {handle!r}")
    owner, model, framework, variation = parts[:4]
    root = Path(root)
    for base in (root / "models" / owner, root):
        versions = [
            d
            for variation_dir in _descend(base, [model, framework, variation])
            for d in variation_dir.iterdir()
            if d.is_dir() and (len(parts) == 4 or d.name == parts[4])
        ]
        for version in sorted(versions, key=_version_order, reverse=True):
            inner = [version] + sorted(d for d in version.iterdir() if d.is_dir())
            holding = [d for d in inner if (d / "config.json").is_file()]
            if holding and (holding[0] == version or len(holding) == 1):
                return holding[0]
    return None


def _descend(base: Path, names: list[str]) -> list[Path]:
    """Every ``base / names[0] / names[1] / ...``, each name matched without regard to case."""
    paths = [base]
    for name in names:
        paths = [
            d for p in paths if p.is_dir() for d in sorted(p.iterdir()) if d.is_dir() and d.name.lower() == name.lower()
        ]
    return paths


def _version_order(version: Path) -> tuple[int, str]:
    return (int(version.name), "") if version.name.isdigit() else (-1, version.name)
