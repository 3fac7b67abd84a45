"""A Hugging Face hub of the tests' own on 127.0.0.1, for ``appliance models pull`` (``HF_ENDPOINT=<url>``).

It serves the few routes ``huggingface_hub`` calls for a pull, as the real hub answers them:

- ``GET /api/models/<repo>/tree/<revision>``: the repository's files (``list_repo_files``);
- ``POST /api/models/<repo>/paths-info/<revision>``: the named files with their git blob id and, as for every GGUF on
  the hub, their LFS sha256 and size (``get_paths_info``);
- ``HEAD`` / ``GET /<repo>/resolve/<revision>/<file>``: the file's metadata (``X-Repo-Commit``, ``ETag``,
  ``Content-Length``) and its bytes, a ``Range: bytes=N-`` request answered ``206`` (``hf_hub_download``).

A repository or file it does not have is a 404 with the hub's ``X-Error-Code``. ``cut_first``: the first GET of a
file sends half of it and closes the connection (a dropped download); ``served``: bytes to serve instead of a file's
own (its reported checksum stays the true one: a corrupt download). Every request is recorded.
"""

from __future__ import annotations

import hashlib
import json
import re
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlsplit

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@dataclass
class Hub:
    repos: dict[str, dict[str, bytes]]
    cut_first: bool = False
    served: dict[str, bytes] = field(default_factory=dict)
    requests: list[tuple[str, str, dict[str, str]]] = field(default_factory=list)
    url: str = ""
    _cut: set[str] = field(default_factory=set)

    def gets(self, file: str) -> list[dict[str, str]]:
        """The headers of every GET of ``file``'s bytes, in order."""
        return [headers for method, path, headers in self.requests if method == "GET" and path.endswith("/" + file)
                and "/resolve/" in path]


def entry(path: str, data: bytes) -> dict:
    """A file as the hub's tree and paths-info list it (an LFS file: its sha256 and size)."""
    blob = hashlib.sha1(b"blob %d\0" % len(data) + data, usedforsecurity=False).hexdigest()
    return {"type": "file", "path": path, "size": len(data), "oid": blob,
            "lfs": {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}}


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    hub: Hub

    def log_message(self, format: str, *args: object) -> None:  # quiet
        pass

    def _record(self) -> None:
        self.hub.requests.append((self.command, unquote(urlsplit(self.path).path), dict(self.headers.items())))

    def _json(self, status: int, body: object, headers: dict[str, str] | None = None) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.end_headers()
        self.wfile.write(data)

    def _missing(self, code: str) -> None:
        self._json(404, {"error": f"{code}"}, {"X-Error-Code": code, "X-Error-Message": code})

    def _repo(self, repo: str) -> dict[str, bytes] | None:
        found = self.hub.repos.get(repo)
        if found is None:
            self._missing("RepoNotFound")
        return found

    def do_GET(self) -> None:
        self._record()
        path = unquote(urlsplit(self.path).path)
        tree = re.fullmatch(r"/api/models/([^/]+/[^/]+)/tree/([^/]+)(/.*)?", path)
        if tree:
            files = self._repo(tree.group(1))
            if files is not None:
                self._json(200, [entry(name, data) for name, data in sorted(files.items())])
            return
        self._resolve(path, body=True)

    def do_HEAD(self) -> None:
        self._record()
        self._resolve(unquote(urlsplit(self.path).path), body=False)

    def do_POST(self) -> None:
        self._record()
        path = unquote(urlsplit(self.path).path)
        length = int(self.headers.get("Content-Length", "0"))
        form = parse_qs(self.rfile.read(length).decode())
        info = re.fullmatch(r"/api/models/([^/]+/[^/]+)/paths-info/([^/]+)", path)
        if info is None:
            self._json(404, {"error": "no route"})
            return
        files = self._repo(info.group(1))
        if files is not None:
            self._json(200, [entry(name, files[name]) for name in form.get("paths", []) if name in files])

    def _resolve(self, path: str, *, body: bool) -> None:
        found = re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path)
        if found is None:
            self._json(404, {"error": "no route"})
            return
        files = self._repo(found.group(1))
        if files is None:
            return
        name = found.group(3)
        if name not in files:
            self._missing("EntryNotFound")
            return
        data = self.hub.served.get(name, files[name])
        start = 0
        match = re.fullmatch(r"bytes=(\d+)-", self.headers.get("Range", ""))
        if match and body:
            start = int(match.group(1))
        self.send_response(206 if start else 200)
        self.send_header("X-Repo-Commit", COMMIT)
        self.send_header("ETag", f'"{hashlib.sha256(files[name]).hexdigest()}"')
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("Content-Length", str(len(data) - start))
        if start:
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        self.end_headers()
        if not body:
            return
        if self.hub.cut_first and name not in self.hub._cut:
            self.hub._cut.add(name)
            self.wfile.write(data[start:len(data) // 2])
            self.wfile.flush()
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)
            return
        self.wfile.write(data[start:])


@contextmanager
def serving(hub: Hub) -> Iterator[Hub]:
    """``hub`` on 127.0.0.1 (an ephemeral port: ``hub.url``) while the block runs."""
    handler = type("Handler", (_Handler,), {"hub": hub})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    hub.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, name="hub", daemon=True)
    thread.start()
    try:
        yield hub
    finally:
        server.shutdown()
        server.server_close()


def closed_port() -> int:
    """A port nothing listens on (bound, then closed)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]
