"""Name a checkpoint by its Hugging Face repo id: ``ORG/NAME`` or ``ORG/NAME@REVISION``.

:func:`resolve_source` turns what a user typed into a local path. An existing file or folder
is itself (a local folder always wins over a repo id of the same spelling). Otherwise a string
shaped like a repo id is looked up with ``huggingface_hub.snapshot_download``: first in the local
hub cache (the revision may be a branch or tag, resolved through ``refs/``, or a commit hash),
downloading only the files ``zipmoe pack`` reads (safetensors, their index, config, tokenizer
and generation files) unless huggingface_hub is offline and when the hub is reachable. A repo
id that is neither cached nor reachable is one :class:`~zipmoe.errors.CheckpointError` line.

Where the cache is and whether to go online are huggingface_hub's own settings, as it read them
when it was imported (``huggingface_hub.constants.HF_HUB_CACHE``: ``HF_HUB_CACHE``, else
``HF_HOME``/hub, else ``$XDG_CACHE_HOME/huggingface/hub``; ``constants.HF_HUB_OFFLINE``:
``HF_HUB_OFFLINE``); :func:`resolve_source` takes a ``cache_dir`` to use another folder.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from zipmoe.errors import CheckpointError

__all__ = ["is_repo_id", "resolve_source", "hub_cache_dir", "SourceRef"]

_NAME = r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9])?"
_REPO_ID = re.compile(rf"^({_NAME})/({_NAME})(?:@([A-Za-z0-9][A-Za-z0-9._/-]{{0,199}}))?$")


def is_repo_id(text: str) -> bool:
    """Whether ``text`` has the shape ``ORG/NAME`` or ``ORG/NAME@REVISION``."""
    return bool(_REPO_ID.match(str(text))) and ".." not in str(text).split("@")[0]


def hub_cache_dir() -> Path:
    """The hub cache folder huggingface_hub uses (``huggingface_hub.constants.HF_HUB_CACHE``)."""
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def _offline() -> bool:
    """Whether huggingface_hub is in offline mode (``constants.HF_HUB_OFFLINE``)."""
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


class SourceRef:
    """A resolved source: ``path`` to open, and ``name`` to record (the repo id when it was one)."""

    def __init__(self, path: Path, name: str, repo_id: str | None = None, revision: str | None = None):
        self.path, self.name, self.repo_id, self.revision = path, name, repo_id, revision

    def __fspath__(self) -> str:
        return str(self.path)


def resolve_source(source, allow_patterns: list[str] | None = None, cache_dir=None) -> SourceRef:
    """A local path, or the snapshot folder of a hub repo id (see the module docstring).
    ``allow_patterns``: the files to download (default: all); files already cached are used.
    ``cache_dir``: the hub cache folder (default: huggingface_hub's, :func:`hub_cache_dir`)."""
    text = os.fspath(source) if not isinstance(source, str) else source
    p = Path(text).expanduser()
    if p.exists() or not is_repo_id(text):
        return SourceRef(p, p.resolve().name if p.exists() else p.name)
    m = _REPO_ID.match(text)
    repo = f"{m.group(1)}/{m.group(2)}"
    rev = m.group(3)
    where = f"{text}: no such folder, and"
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub import errors as hf_errors
    except ImportError:  # pragma: no cover - a dependency of zipmoe and of transformers
        raise CheckpointError(f"{where} huggingface_hub is not installed to look it up on the hub") from None
    cache = Path(cache_dir).expanduser() if cache_dir is not None else hub_cache_dir()
    offline = _offline()
    try:
        folder = snapshot_download(repo_id=repo, revision=rev, cache_dir=cache, local_files_only=offline,
                                   allow_patterns=allow_patterns)
    except (hf_errors.LocalEntryNotFoundError, hf_errors.OfflineModeIsEnabled):
        if offline:
            raise CheckpointError(
                f"{where} {repo}{'@' + rev if rev else ''} is not in the local hub cache ({cache}); "
                f"HF_HUB_OFFLINE is set, so it was not downloaded") from None
        raise CheckpointError(
            f"{where} {repo}{'@' + rev if rev else ''} is neither in the local hub cache ({cache}) nor "
            f"reachable on the hub (no network?)") from None
    except hf_errors.RevisionNotFoundError:
        raise CheckpointError(f"{where} the hub repo {repo} has no revision {rev!r}") from None
    except hf_errors.GatedRepoError:
        raise CheckpointError(f"{where} the hub repo {repo} is gated: accept its terms on the hub and log in "
                              f"(hf auth login), then try again") from None
    except hf_errors.RepositoryNotFoundError:
        raise CheckpointError(f"{where} no hub repo {repo} (or it is private: log in with hf auth login)") from None
    except hf_errors.HFValidationError as exc:
        raise CheckpointError(f"{where} not a valid hub repo id: {str(exc).splitlines()[0]}") from None
    except (hf_errors.HfHubHTTPError, OSError, ValueError) as exc:
        msg = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise CheckpointError(f"{where} {repo} could not be fetched from the hub: {msg}") from None
    except Exception as exc:  # requests/httpx connection errors and the like: still one line
        msg = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise CheckpointError(f"{where} {repo} could not be fetched from the hub: {msg}") from None
    return SourceRef(Path(folder), f"{repo}{'@' + rev if rev else ''}", repo, rev)
