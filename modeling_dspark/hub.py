"""Where a drafter's files are: a local directory, a shipped drafter by name, or a Hugging Face Hub snapshot fetched
by `huggingface_hub`."""

from __future__ import annotations

import difflib
import os
from pathlib import Path

# what a drafter checkpoint consists of in every supported format: config.json (and other JSON metadata) + weights
DRAFTER_FILE_PATTERNS = ["*.json", "*.safetensors"]

SHIPPED_DRAFTERS_DIR = Path(__file__).resolve().parent / "drafters"
"""The drafters shipped inside the package (one per packaged target), each in a directory named as the drafter."""


def shipped_drafter_dir(name: str | os.PathLike) -> Path | None:
    """The directory of the drafter shipped with this package under ``name`` (e.g. ``"smollm2-135m-dspark"``),
    else None (``name`` is not a shipped drafter's name)."""
    name = str(name)
    if not name or "/" in name or name in (".", ".."):
        return None
    path = SHIPPED_DRAFTERS_DIR / name
    return path if (path / "config.json").is_file() else None


def shipped_drafter_names() -> list[str]:
    """The names of the shipped drafters (:func:`shipped_drafter_dir`), sorted."""
    return sorted(p.parent.name for p in SHIPPED_DRAFTERS_DIR.glob("*/config.json"))


def is_hub_repo_id(name: str) -> bool:
    """Whether ``name`` has the form of a Hub repository id (``"name"`` or ``"org/name"``).

    Paths like ``./x``, ``../x``, ``~/x``, ``/abs/x`` or ``a/b/c`` are never repository ids.
    """
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def resolve_pretrained_dir(
    name_or_path: str | os.PathLike,
    *,
    cache_dir: str | os.PathLike | None = None,
    revision: str | None = None,
    local_files_only: bool = False,
    token: str | bool | None = None,
    force_download: bool = False,
    subfolder: str = "",
) -> Path:
    """The local directory holding the checkpoint ``name_or_path``.

    In order: an existing directory, as is (a relative path is relative to the working directory); the name of a
    drafter shipped inside this package (:func:`shipped_drafter_dir`, e.g. ``"smollm2-135m-dspark"``); anything else
    of the form of a Hub repository id, fetched with :func:`huggingface_hub.snapshot_download` (only ``*.json`` and
    ``*.safetensors``), honouring ``cache_dir``, ``revision``, ``token``, ``force_download`` and
    ``local_files_only`` / ``HF_HUB_OFFLINE=1`` (then only the local Hugging Face cache is read). A relative path
    whose parent directory exists here (``runs/x`` with ``runs/`` present) is a missing local directory and is
    reported at once, without a Hub lookup.

    Raises:
        FileNotFoundError: ``name_or_path`` is none of these, is a missing directory under an existing one, or is a
            repository id that could not be fetched (not in the cache when offline, unknown repository or revision,
            no network); the message names the local path it also tried (where it differs from the input) and the
            shipped drafters (the closest first, for a bare name like one of them), never only a network error.
        NotADirectoryError: ``name_or_path`` is an existing file.
    """
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return _in_subfolder(path, subfolder, str(name_or_path))
    if path.exists():
        raise NotADirectoryError(f"drafter {str(name_or_path)!r} is a file; give the checkpoint's directory")
    name = str(name_or_path)
    shipped = shipped_drafter_dir(name)
    if shipped is not None:
        return _in_subfolder(shipped, subfolder, name)
    close = difflib.get_close_matches(name, shipped_drafter_names(), n=1) if "/" not in name else []  # a bare name
    hint = (f" (the shipped drafter of that name loads as {path.name!r})" if shipped_drafter_dir(path.name)
            else f" ({f'did you mean {close[0]!r}? ' if close else ''}shipped drafters: "
                 f"{', '.join(shipped_drafter_names())})")
    if not is_hub_repo_id(name) or (path.parent != Path(".") and path.parent.is_dir()):
        where = "" if str(path.resolve()) == name else f" (looked in {path.resolve()})"
        raise FileNotFoundError(f"drafter directory not found: {name!r}{where}{hint}")
    from huggingface_hub import snapshot_download

    patterns = [f"{subfolder}/{p}" for p in DRAFTER_FILE_PATTERNS] if subfolder else DRAFTER_FILE_PATTERNS
    try:
        snapshot = snapshot_download(
            name, revision=revision, cache_dir=cache_dir, local_files_only=local_files_only, token=token,
            force_download=force_download, allow_patterns=patterns,
        )
    except Exception as err:  # huggingface_hub's errors: not cached offline, unknown repo/revision, HTTP, connection
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else ""
        raise FileNotFoundError(
            f"drafter {name!r} not found: no local directory {str(path.resolve())!r}, and the Hugging Face Hub "
            f"repository {name!r}{f' (revision {revision!r})' if revision else ''} could not be fetched"
            f"{' from the local cache' if local_files_only or _hub_offline() else ''}: "
            f"{type(err).__name__}: {first_line}{hint}"
        ) from None
    return _in_subfolder(Path(snapshot), subfolder, name)


def _in_subfolder(root: Path, subfolder: str, name: str) -> Path:
    if not subfolder:
        return root
    if not (root / subfolder).is_dir():
        raise FileNotFoundError(f"drafter {name!r} has no subfolder {subfolder!r}")
    return root / subfolder


def _hub_offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)
