"""KV files: one parked conversation's KV state on disk (the third tier after the device and host RAM).

A file is ``MAGIC``, a little-endian u32 header length, the header (JSON) and the state bytes llama.cpp saved for
the sequence. The header says what the state is valid for (format version, model file identity, ``n_ctx``, cache
type, V layout) and what it holds (the count and digest of the tokens whose cells it holds, the state's length and
CRC-32). A file is written atomically (a temporary sibling, ``fsync``, ``rename``, ``fsync`` of the folder): a reader
sees a whole file or none. :func:`read` checks all of it against what the conversation expects and raises
:class:`KvFileError` with the reason on any difference: the caller discards the file and re-evaluates the tokens, so
a bad file costs time, never a crash or a wrong continuation.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import struct
import tempfile
import zlib
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from appliance.daemon.store import pack_tokens

MAGIC = b"APPLIANCE-KV\n"
FORMAT_VERSION = 1
MAX_HEADER = 64 * 1024
_LENGTH = struct.Struct("<I")


class KvFileError(Exception):
    """A KV file that cannot be used (why, in one line)."""


@dataclass(frozen=True)
class Validity:
    """What a state is valid for: the same model file, context size, cache type and V layout."""

    model_file: str
    n_ctx: int
    cache_type: str
    flash_attention: bool  # the V layout: True = as flash attention stores it (auto or on), False = transposed (off)


@dataclass(frozen=True)
class Header:
    version: int
    model_file: str
    n_ctx: int
    cache_type: str
    flash_attention: bool
    n_tokens: int  # the cells the state holds: the conversation's first n_tokens tokens
    tokens_digest: str
    state_bytes: int
    crc32: int

    @property
    def validity(self) -> Validity:
        return Validity(self.model_file, self.n_ctx, self.cache_type, self.flash_attention)


def tokens_digest(tokens: Sequence[int]) -> str:
    return hashlib.blake2b(pack_tokens(tokens), digest_size=16).hexdigest()


def encode_header(header: Header) -> bytes:
    text = json.dumps(asdict(header), sort_keys=True, separators=(",", ":")).encode()
    return MAGIC + _LENGTH.pack(len(text)) + text


def write(path: Path, validity: Validity, tokens: Sequence[int], state: memoryview | bytes) -> int:
    """Write ``state`` (the KV state of ``tokens``' cells) to ``path`` atomically; returns the file's size. On any
    failure the temporary file is removed, ``path`` is as it was, and the :class:`OSError` raised."""
    header = Header(FORMAT_VERSION, validity.model_file, validity.n_ctx, validity.cache_type,
                    validity.flash_attention, len(tokens), tokens_digest(tokens), len(state), zlib.crc32(state))
    head = encode_header(header)
    fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        try:
            with os.fdopen(fd, "wb", closefd=False) as fh:
                fh.write(head)
                fh.write(state)
                fh.flush()
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
        raise
    sync_folder(path.parent)
    return len(head) + len(state)


def sync_folder(folder: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def read_header(fh: object) -> Header:
    """The header at the start of the open binary file ``fh``; :class:`KvFileError` when it is not one."""
    read = fh.read  # type: ignore[attr-defined]
    magic = read(len(MAGIC))
    if magic != MAGIC:
        raise KvFileError("not a KV file (bad magic)")
    raw = read(_LENGTH.size)
    if len(raw) != _LENGTH.size:
        raise KvFileError("truncated header")
    (length,) = _LENGTH.unpack(raw)
    if length > MAX_HEADER:
        raise KvFileError(f"header of {length} bytes")
    text = read(length)
    if len(text) != length:
        raise KvFileError("truncated header")
    try:
        fields = json.loads(text)
        header = Header(**fields)
    except (ValueError, TypeError) as exc:
        raise KvFileError(f"unreadable header ({exc})") from None
    if header.version != FORMAT_VERSION:
        raise KvFileError(f"format version {header.version}, this appliance reads {FORMAT_VERSION}")
    return header


def read(path: Path, validity: Validity, tokens: Sequence[int]) -> tuple[bytearray, int]:
    """The state in ``path`` and the count of tokens it holds, after checking it is valid for ``validity`` and holds
    a prefix of ``tokens``; :class:`KvFileError` (a mismatch, a bad checksum, a short file) or :class:`OSError`."""
    with open(path, "rb") as fh:
        header = read_header(fh)
        if header.validity != validity:
            raise KvFileError(f"made for {_differs(header.validity, validity)}")
        if header.n_tokens > len(tokens) or header.n_tokens < 1:
            raise KvFileError(f"holds {header.n_tokens} tokens, the conversation has {len(tokens)}")
        if tokens_digest(tokens[:header.n_tokens]) != header.tokens_digest:
            raise KvFileError("its tokens are not the conversation's")
        state = bytearray(header.state_bytes)
        got = fh.readinto(state)
        if got != header.state_bytes or fh.read(1):
            raise KvFileError(f"state of {got} bytes, the header says {header.state_bytes}")
    if zlib.crc32(state) != header.crc32:
        raise KvFileError("checksum mismatch")
    return state, header.n_tokens


def _differs(made: Validity, wanted: Validity) -> str:
    parts = []
    for key, value in asdict(made).items():
        now = getattr(wanted, key)
        if value != now:
            parts.append(f"{key} {value!r} (now {now!r})")
    return ", ".join(parts)
