"""The real tokenizers and chat templates that llama.cpp ships, taken from the pinned llama-cpp-python sdist.

The sdist carries ``vendor/llama.cpp/models/ggml-vocab-*.gguf`` (vocab-only GGUFs of real tokenizers) and
``vendor/llama.cpp/models/templates/*.jinja`` (real models' chat templates). Only those files are extracted, once,
into ``$XDG_CACHE_HOME/appliance/vendored/<version>/`` (default ``~/.cache/...``), atomically: into a temporary
folder beside it, then renamed. The sdist comes from pip's temporary folder when a pip install left it there,
else from ``pip download`` (pip's own cache, else PyPI: about 77 MB, 15 to 50 s measured here, most of it pip
preparing the sdist's metadata).

Only the tests need these files (``appliance models make-tiny --vocab`` takes any path), so this module lives in
tests/. ``python tests/vendored.py`` fetches them and prints the folder (for a set-up script to run ahead).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import tomllib
from collections.abc import Iterable
from pathlib import Path, PurePosixPath

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "llama-cpp-python"
MODELS_DIR = PurePosixPath("vendor/llama.cpp/models")
VOCAB_PATTERN = re.compile(r"ggml-vocab-[A-Za-z0-9._-]+\.gguf")
TEMPLATE_PATTERN = re.compile(r"[A-Za-z0-9._-]+\.jinja")
TEMPLATES = "templates"
COMPLETE = ".complete"  # written last into the extracted folder: its presence means the folder is whole
DOWNLOAD_TIMEOUT_S = 600
PIP_TIMEOUT_S = 30  # seconds per attempt: offline, pip gives up in a minute or two, not after 5 tries of 180 s
PIP_RETRIES = 2


class VendoredUnavailable(Exception):
    """The sdist could not be had (offline, PyPI refusing, a broken archive): the message says why."""


def pinned_version(dependencies: Iterable[str]) -> str:
    """The version that ``llama-cpp-python==X`` pins among the project's dependencies."""
    for requirement in dependencies:
        name, sep, version = requirement.replace(" ", "").partition("==")
        if sep and name.lower().replace("_", "-") == PACKAGE:
            return version
    raise VendoredUnavailable(f"pyproject.toml does not pin {PACKAGE} with '=='")


def project_version() -> str:
    with open(ROOT / "pyproject.toml", "rb") as f:
        return pinned_version(tomllib.load(f)["project"]["dependencies"])


def cache_folder(version: str, environ: dict[str, str] | os._Environ[str] = os.environ) -> Path:
    base = environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "appliance" / "vendored" / version


def wanted(member: str) -> str | None:
    """Where a file of the source tree goes in the cache folder (``ggml-vocab-X.gguf``, ``templates/Y.jinja``), or
    None for every other file. ``member`` is its path below the tree's top folder (``vendor/llama.cpp/...``)."""
    path = PurePosixPath(member)
    if path.parent == MODELS_DIR and VOCAB_PATTERN.fullmatch(path.name):
        return path.name
    if path.parent == MODELS_DIR / TEMPLATES and TEMPLATE_PATTERN.fullmatch(path.name):
        return f"{TEMPLATES}/{path.name}"
    return None


def below_top(name: str) -> str:
    """A tar member's path without the sdist's top folder (``llama_cpp_python-0.3.36/``)."""
    return name.partition("/")[2]


def sdist_name(version: str) -> str:
    return f"{PACKAGE.replace('-', '_')}-{version}.tar.gz"


def pip_leftovers(version: str, temp: Path) -> list[Path]:
    """Sdists of ``version`` that a running or interrupted pip install left in ``temp`` (a download still under way
    is refused when it is read: its archive ends early). pip's unpacked source trees are not used: nothing tells a
    tree pip is still unpacking from a whole one."""
    return sorted(temp.glob(f"pip-unpack-*/{sdist_name(version)}"))


def extract_sdist(sdist: Path, into: Path) -> int:
    """Write the wanted files of ``sdist`` under ``into``; returns how many."""
    count = 0
    try:
        with tarfile.open(sdist, "r:gz") as archive:
            for member in archive:
                target = wanted(below_top(member.name))
                if target is None or not member.isfile():
                    continue
                source = archive.extractfile(member)
                assert source is not None  # a regular file always has data
                with source, open(into / target, "wb") as out:
                    shutil.copyfileobj(source, out)
                count += 1
    except (OSError, tarfile.TarError, EOFError) as exc:
        raise VendoredUnavailable(f"cannot read {sdist}: {exc}") from None
    return count


def download(version: str, into: Path) -> Path:
    """``pip download`` the sdist into ``into`` and return its path."""
    command = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
               "--timeout", str(PIP_TIMEOUT_S), "--retries", str(PIP_RETRIES), f"{PACKAGE}=={version}", "-d", str(into)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=DOWNLOAD_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise VendoredUnavailable(f"pip download {PACKAGE}=={version} failed: {exc}") from None
    sdist = into / sdist_name(version)
    if done.returncode != 0 or not sdist.is_file():
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise VendoredUnavailable(f"pip download {PACKAGE}=={version} failed (exit {done.returncode}): {last}")
    return sdist


def fill(folder: Path, version: str, temp: Path) -> None:
    """Put the wanted files into ``folder``: from a pip leftover when one is usable, else from a download."""
    (folder / TEMPLATES).mkdir(parents=True)
    for sdist in pip_leftovers(version, temp):
        try:
            if extract_sdist(sdist, folder):
                return
        except VendoredUnavailable:
            continue  # pip removed it, or is still downloading it: the next, else a download
    with tempfile.TemporaryDirectory(prefix="appliance-sdist-") as download_dir:
        sdist = download(version, Path(download_dir))
        if not extract_sdist(sdist, folder):
            raise VendoredUnavailable(f"{sdist.name} has no {MODELS_DIR}/ggml-vocab-*.gguf or templates")


def vendored_folder(version: str | None = None) -> Path:
    """The cache folder holding the sdist's vocab GGUFs and ``templates/*.jinja``, fetched the first time."""
    version = version or project_version()
    folder = cache_folder(version)
    if (folder / COMPLETE).is_file():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix=f".{version}-", dir=folder.parent))
    try:
        fill(partial / "files", version, Path(tempfile.gettempdir()))
        (partial / "files" / COMPLETE).write_text(f"{PACKAGE} {version}\n")
        if folder.exists() and not (folder / COMPLETE).is_file():
            shutil.rmtree(folder)  # not one this function renamed into place (those are complete): replaced
        try:
            os.rename(partial / "files", folder)
        except OSError:
            if not (folder / COMPLETE).is_file():  # not a concurrent fetch that finished first
                raise
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return folder


def vocab_names(folder: Path) -> list[str]:
    """The vocabularies in ``folder`` by their short names (``qwen2`` for ggml-vocab-qwen2.gguf)."""
    return sorted(p.name.removeprefix("ggml-vocab-").removesuffix(".gguf") for p in folder.glob("ggml-vocab-*.gguf"))


def template_names(folder: Path) -> list[str]:
    return sorted(p.stem for p in (folder / TEMPLATES).glob("*.jinja"))


def vocab_path(folder: Path, name: str) -> Path:
    return folder / f"ggml-vocab-{name}.gguf"


def template_path(folder: Path, name: str) -> Path:
    return folder / TEMPLATES / f"{name}.jinja"


if __name__ == "__main__":
    try:
        print(vendored_folder())
    except VendoredUnavailable as exc:
        print(f"vendored: {exc}", file=sys.stderr)
        sys.exit(1)
