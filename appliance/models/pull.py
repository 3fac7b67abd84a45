"""``appliance models pull REPO [FILE]``: fetch a GGUF file from a Hugging Face repository, verify it, then add it
(:func:`appliance.models.add.add_model`).

0. One TCP connection to the hub (or to the proxy the environment names for it): a box without network is told so at
   once, not after huggingface_hub's retries.
1. The file: FILE, else the repository's only ``.gguf`` file (several are refused with their list, none too).
2. Its checksum as the Hub's API reports it (``paths-info``): the LFS sha256 (GGUF files are LFS files), else the git
   blob id of a small file.
3. The download, with ``huggingface_hub`` (``HF_ENDPOINT`` names another hub or a mirror; ``HF_TOKEN`` logs in), into
   the first ``model_dirs`` folder itself (no second copy), with huggingface_hub's progress bar on a terminal: a
   connection that drops mid-file is resumed from the bytes already written (a ``Range`` request; huggingface_hub
   keeps no partial file across runs: a pull that failed starts over).
4. The file's checksum is computed and compared: a mismatch removes the file and adds nothing.
5. :func:`~appliance.models.add.add_model` checks it (header, trial load) and adds its entry to the config.

Every failure is one :class:`~appliance.errors.ApplianceError`: ``HUB_UNAVAILABLE`` when the hub cannot be reached (a
box without internet) or fails, ``UNKNOWN_MODEL`` for a repository, revision or file it does not have, ``FORBIDDEN``
for a gated or private one, ``MODEL_LOAD_FAILED`` for a checksum mismatch.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shlex
import socket
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import urlsplit
from urllib.request import getproxies, proxy_bypass

from appliance.config.filewrite import ConfigNotWritable, check_writable
from appliance.config.validate import Config
from appliance.errors import ApplianceError
from appliance.models import add, entry

log = logging.getLogger(__name__)

CHUNK_BYTES = 1 << 20


@dataclass(frozen=True)
class Checksum:
    """What the Hub says a file's content hashes to: ``sha256`` (an LFS file) or ``git-sha1`` (a git blob id)."""

    kind: str
    value: str
    size: int


@dataclass(frozen=True)
class Pulled:
    """A pulled file: where it came from (``repo``, ``file``, ``revision``), its verified checksum, and the add."""

    repo: str
    file: str
    revision: str | None
    checksum: Checksum
    added: add.Added


def pick_file(repo: str, files: list[str], file: str | None) -> str:
    """The repository file to pull (pure): ``file`` when given, else the only ``.gguf`` of ``files``. BAD_REQUEST when
    there are several (their list in the message and ``details.files``) or none."""
    if file is not None:
        return file
    ggufs = sorted(name for name in files if name.lower().endswith(".gguf"))
    if len(ggufs) == 1:
        return ggufs[0]
    if not ggufs:
        raise ApplianceError("BAD_REQUEST", f"{repo} has no .gguf file", {"repo": repo, "files": sorted(files)[:50]})
    raise ApplianceError("BAD_REQUEST", f"{repo} has {len(ggufs)} .gguf files; name one: {', '.join(ggufs)}",
                         {"repo": repo, "files": ggufs})


def checksum_of(info: Any) -> Checksum:
    """The checksum a ``huggingface_hub`` ``RepoFile`` reports: its LFS sha256, else its git blob id."""
    lfs = getattr(info, "lfs", None)
    if lfs is not None:
        return Checksum("sha256", str(lfs.sha256).lower(), int(lfs.size))
    return Checksum("git-sha1", str(info.blob_id).lower(), int(info.size))


def file_checksum(path: Path, kind: str) -> str:
    """``path``'s content hashed the way the Hub hashes it: sha256, or git's blob id (sha1 of ``blob <size>\\0`` and
    the content)."""
    if kind == "sha256":
        digest = hashlib.sha256()
    else:
        digest = hashlib.sha1(usedforsecurity=False)
        digest.update(b"blob %d\0" % path.stat().st_size)
    with path.open("rb") as file:
        while chunk := file.read(CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def pull_model(config_path: str | os.PathLike[str], repo: str, file: str | None = None, *,
               revision: str | None = None, name: str | None = None, n_ctx: int | None = None,
               data_dir: Path | None = None, trial: add.Trial = add.trial_load) -> Pulled:
    """Pull ``file`` (or the repository's only GGUF) of the Hugging Face repository ``repo`` at ``revision`` (default:
    its main branch) into the first ``model_dirs`` folder of the config at ``config_path``, verify its checksum and
    add it as model ``name`` (default: from the file name). See the module docstring."""
    config_file = Path(config_path)
    config = add.read_config(config_file, data_dir)
    folder = _first_folder(config)
    try:  # before a download of gigabytes, not after
        check_writable(config_file)
        _check_folder_writable(folder)
    except ConfigNotWritable as exc:
        raise add.not_writable(exc, root_command(repo, file, config_file, revision, name, n_ctx, data_dir)) from None
    with _hub_errors(repo, revision):
        from huggingface_hub import HfApi, constants, hf_hub_download

        check_reachable(constants.ENDPOINT)

        api = HfApi()
        chosen = pick_file(repo, api.list_repo_files(repo, revision=revision) if file is None else [], file)
        _check_inside(chosen)
        model_name = entry.model_name_for(PurePosixPath(chosen).name) if name is None else name
        taken = entry.name_owner(config, model_name)
        if taken is not None:  # before a download of gigabytes, not after
            raise taken
        found = api.get_paths_info(repo, [chosen], revision=revision)
        if not found or not hasattr(found[0], "size"):
            raise ApplianceError("UNKNOWN_MODEL", f"{repo} has no file {chosen}", {"repo": repo, "file": chosen})
        expected = checksum_of(found[0])
        local = Path(hf_hub_download(repo, chosen, revision=revision, local_dir=folder))
    got = file_checksum(local, expected.kind)
    if got != expected.value:
        _remove_download(folder, chosen)
        raise ApplianceError("MODEL_LOAD_FAILED", f"{chosen} from {repo} does not match its {expected.kind} checksum "
                             f"(expected {expected.value}, got {got}): removed, nothing added",
                             {"repo": repo, "file": chosen, "check": expected.kind, "expected": expected.value,
                              "got": got})
    log.info("pulled %s from %s: %s %s verified", chosen, repo, expected.kind, got)
    added = add.add_model(config_file, local, name=model_name, n_ctx=n_ctx, data_dir=data_dir, trial=trial)
    return Pulled(repo, chosen, revision, expected, added)


PROBE_TIMEOUT_S = 10.0


def check_reachable(endpoint: str, timeout_s: float = PROBE_TIMEOUT_S) -> None:
    """Open one TCP connection to ``endpoint``'s host (or to the proxy the environment names for it: ``HTTPS_PROXY``,
    ``NO_PROXY``…) and close it; ``HUB_UNAVAILABLE`` when that fails."""
    url = urlsplit(endpoint)
    proxy = None if url.hostname is None or proxy_bypass(url.hostname) else getproxies().get(url.scheme)
    target = urlsplit(proxy) if proxy else url
    port = target.port or (443 if target.scheme == "https" else 80)
    through = f" through the proxy {target.hostname}:{port}" if proxy else ""
    try:
        socket.create_connection((target.hostname or "", port), timeout=timeout_s).close()
    except OSError as exc:
        raise ApplianceError("HUB_UNAVAILABLE", f"cannot reach {endpoint}{through} (no network, or HF_ENDPOINT is "
                             f"wrong): {exc.strerror or exc}", {"endpoint": endpoint, "proxy": proxy}) from None


def root_command(repo: str, file: str | None, config: Path, revision: str | None, name: str | None,
                 n_ctx: int | None, data_dir: Path | None) -> str:
    """The ``sudo appliance models pull …`` that does this pull as root (a config or folder this user may not
    write)."""
    program = Path(sys.executable).with_name("appliance")
    words = ["sudo", str(program) if program.is_file() else "appliance", "models", "pull", repo]
    words += [] if file is None else [file]
    words += [] if revision is None else ["--revision", revision]
    words += [] if name is None else ["--name", name]
    words += [] if n_ctx is None else ["--n-ctx", str(n_ctx)]
    words += ["--config", os.path.abspath(config)]
    words += [] if data_dir is None else ["--data-dir", os.path.abspath(data_dir)]
    return shlex.join(words)


def _check_folder_writable(folder: Path) -> None:
    """The model folder (or the nearest of its parents that exists: it is made) takes new files."""
    existing = folder
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    effective = os.access in os.supports_effective_ids
    if not os.access(existing, os.W_OK | os.X_OK, effective_ids=effective):
        raise ConfigNotWritable(existing, f"the model folder {folder} is not writable by this process (user id "
                                f"{os.geteuid()})", read_only=True)


def _first_folder(config: Config) -> Path:
    if not config.model_dirs:
        raise ApplianceError("BAD_REQUEST", "model_dirs is empty: there is no folder to pull the model into",
                             {"setting": "model_dirs"})
    return Path(os.path.realpath(config.model_dirs[0]))


def _check_inside(file: str) -> None:
    """A repository path stays inside the folder it is downloaded to (no ``..``, not absolute)."""
    parts = PurePosixPath(file).parts
    if not parts or PurePosixPath(file).is_absolute() or ".." in parts:
        raise ApplianceError("BAD_REQUEST", f"not a file path inside a repository: {file!r}", {"file": file})


def _remove_download(folder: Path, file: str) -> None:
    """Remove a refused download: the file and huggingface_hub's record of it (so the next pull fetches it anew)."""
    for path in (folder / file, folder / ".cache" / "huggingface" / "download" / f"{file}.metadata"):
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


@contextlib.contextmanager
def _hub_errors(repo: str, revision: str | None) -> Iterator[None]:
    """huggingface_hub's exceptions as one :class:`ApplianceError` each (one line for the CLI, no traceback)."""
    try:
        yield
    except ApplianceError:
        raise
    except Exception as exc:
        raise hub_error(exc, repo, revision) from None


def hub_error(exc: BaseException, repo: str, revision: str | None) -> ApplianceError:
    """The :class:`ApplianceError` of an exception raised by huggingface_hub (or its HTTP client)."""
    import httpx2
    from huggingface_hub import constants, errors

    where = {"repo": repo, "revision": revision, "endpoint": constants.ENDPOINT}
    for cause in _chain(exc):
        if isinstance(cause, errors.GatedRepoError):
            return ApplianceError("FORBIDDEN", f"{repo} is gated: accept its terms on the hub and set HF_TOKEN",
                                  where)
        if isinstance(cause, errors.RepositoryNotFoundError):
            return ApplianceError("UNKNOWN_MODEL", f"no repository {repo} on {constants.ENDPOINT} (a private one needs "
                                  f"HF_TOKEN)", where)
        if isinstance(cause, errors.RevisionNotFoundError):
            return ApplianceError("UNKNOWN_MODEL", f"{repo} has no revision {revision}", where)
        if isinstance(cause, errors.RemoteEntryNotFoundError):
            return ApplianceError("UNKNOWN_MODEL", f"{repo} has no such file", where)
        if isinstance(cause, httpx2.TransportError | errors.OfflineModeIsEnabled | errors.LocalEntryNotFoundError):
            return ApplianceError("HUB_UNAVAILABLE", f"cannot reach {constants.ENDPOINT} (no network, or HF_ENDPOINT "
                                  f"is wrong): {_first_line(cause)}", where)
        if isinstance(cause, errors.HfHubHTTPError):
            status = cause.response.status_code if cause.response is not None else None
            return ApplianceError("HUB_UNAVAILABLE", f"{constants.ENDPOINT} answered HTTP {status}: "
                                  f"{_first_line(cause)}", {**where, "status": status})
    return ApplianceError("HUB_UNAVAILABLE", f"the pull from {constants.ENDPOINT} failed: {type(exc).__name__}: "
                          f"{_first_line(exc)}", where)


def _chain(exc: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
