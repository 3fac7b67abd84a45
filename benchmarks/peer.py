"""llama.cpp's own tools as a peer: ``llama-server`` and ``llama-batched-bench`` built from the llama.cpp source
vendored in the sdist of the pinned llama-cpp-python, run on the same model as the appliance.

``python -m benchmarks.peer build`` builds (about 6 minutes on 2 cores) into the cache and prints the binaries."""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import tomllib
import urllib.request
from pathlib import Path
from types import TracebackType

from benchmarks.protocol.servers import free_port, stop_process

REPO = Path(__file__).resolve().parents[1]
BINARIES = ("llama-server", "llama-batched-bench")
START_TIMEOUT_S = 120.0
CMAKE_OPTIONS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DGGML_BUILD_TESTS=OFF",
    "-DGGML_BUILD_EXAMPLES=OFF",
)


class BuildError(RuntimeError):
    """A step of the peer build failed; the message names the step."""


def pinned_version() -> str:
    """The llama-cpp-python version pinned in pyproject.toml (``llama-cpp-python==X``)."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    for requirement in project["project"]["dependencies"]:
        match = re.fullmatch(r"llama-cpp-python==([0-9][0-9A-Za-z.]*)", requirement.replace(" ", ""))
        if match:
            return match.group(1)
    raise BuildError("pyproject.toml pins no llama-cpp-python==<version> in [project].dependencies")


def default_cache() -> Path:
    return Path.home() / ".cache" / "appliance" / f"llama.cpp-{pinned_version()}"


def built_binaries(cache: Path | None = None) -> dict[str, Path] | None:
    """The peer binaries when both are built in ``cache``, else None."""
    bin_dir = (cache or default_cache()) / "bin"
    paths = {name: bin_dir / name for name in BINARIES}
    if all(path.is_file() and os.access(path, os.X_OK) for path in paths.values()):
        return paths
    return None


def binaries_or_why(no_peer: bool, build_first: bool, cache: Path | None = None) -> tuple[dict[str, Path] | None, str]:
    """The peer's binaries and "measured", or None and why the peer is absent (``--no-peer``, or not built in
    ``cache``); ``build_first`` builds it first when it is not built."""
    if no_peer:
        return None, "absent: --no-peer was given"
    if build_first:
        build(cache)
    binaries = built_binaries(cache)
    if binaries is None:
        return None, (f"absent: llama.cpp is not built in {cache or default_cache()}; run `python -m benchmarks.peer "
                      f"build` (about 6 minutes on 2 cores) or pass --build")
    return binaries, "measured"


def _progress(message: str) -> None:
    print(f"[peer build] {message}", flush=True)


def _run_step(step: str, argv: list[str], cwd: Path, log: Path) -> None:
    _progress(f"{step}: {' '.join(argv)} (log: {log})")
    with open(log, "ab") as out:
        code = subprocess.call(argv, cwd=cwd, stdout=out, stderr=subprocess.STDOUT)
    if code != 0:
        tail = log.read_text(errors="replace")[-3000:]
        raise BuildError(f"peer build step '{step}' failed with exit code {code} (log: {log}):\n{tail}")


def _download_sdist(version: str, dest: Path, log: Path) -> Path:
    _run_step("download sdist", [sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
                                 f"llama-cpp-python=={version}", "-d", str(dest)], dest, log)
    found = sorted(dest.glob(f"llama_cpp_python-{version}.tar.gz"))
    if not found:
        raise BuildError(f"peer build step 'download sdist': pip saved no llama_cpp_python-{version}.tar.gz "
                         f"in {dest}")
    return found[0]


def _unpack_llama_cpp(sdist: Path, version: str, dest: Path) -> Path:
    prefix = f"llama_cpp_python-{version}/vendor/llama.cpp/"
    _progress(f"unpack: {prefix} from {sdist.name}")
    try:
        with tarfile.open(sdist) as archive:
            members = [m for m in archive.getmembers() if m.name.startswith(prefix)]
            if not members:
                raise BuildError(f"peer build step 'unpack': {sdist} holds no {prefix}")
            archive.extractall(dest, members=members, filter="data")
    except (OSError, tarfile.TarError) as exc:
        raise BuildError(f"peer build step 'unpack' failed on {sdist}: {exc}") from exc
    return dest / prefix


def build(cache: Path | None = None) -> Path:
    """Build ``llama-server`` and ``llama-batched-bench`` into ``<cache>/bin`` (default
    ``~/.cache/appliance/llama.cpp-<pin>/``) and return that folder; at once when both are already there."""
    cache = cache or default_cache()
    if built_binaries(cache) is not None:
        _progress(f"already built: {cache / 'bin'}")
        return cache / "bin"
    for tool in ("cmake", "c++"):
        if shutil.which(tool) is None:
            raise BuildError(f"peer build step 'check tools': {tool} is not on PATH")
    version = pinned_version()
    cache.mkdir(parents=True, exist_ok=True)
    log = cache / "build.log"
    log.write_text("")
    work = cache / "work"
    if work.exists():
        shutil.rmtree(work)
    work.mkdir()
    started = time.monotonic()
    sdist = _download_sdist(version, work, log)
    source = _unpack_llama_cpp(sdist, version, work)
    build_dir = work / "build"
    _run_step("cmake configure", ["cmake", "-S", str(source), "-B", str(build_dir), *CMAKE_OPTIONS], work, log)
    jobs = str(max(1, min(2, os.cpu_count() or 1)))
    _progress(f"compiling with -j{jobs} (about 6 minutes on 2 cores)")
    _run_step("cmake build", ["cmake", "--build", str(build_dir), "-j", jobs, "--target", *BINARIES], work, log)
    bin_dir = cache / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name in BINARIES:
        built = build_dir / "bin" / name
        if not built.is_file():
            raise BuildError(f"peer build step 'collect': {built} was not produced (log: {log})")
        shutil.copy2(built, bin_dir / name)
    shutil.rmtree(work)
    _progress(f"built {', '.join(BINARIES)} in {time.monotonic() - started:.0f} s: {bin_dir}")
    return bin_dir


_TABLE_ROW = re.compile(r"^\|\s*\d+\s*\|")


def parse_batched_bench(output: str) -> list[dict[str, float | int]]:
    """The rows of ``llama-batched-bench``'s markdown table (``| PP | TG | B | N_KV | T_PP s | S_PP t/s | T_TG s |
    S_TG t/s | T s | S t/s |``); S_TG is the generation tokens/s of all B sequences together."""
    rows = []
    for line in output.splitlines():
        if not _TABLE_ROW.match(line.strip()):
            continue
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) != 10:
            raise ValueError(f"unexpected llama-batched-bench row (want 10 cells): {line!r}")
        rows.append({"n_prompt": int(cells[0]), "n_gen": int(cells[1]), "n_parallel": int(cells[2]),
                     "n_kv": int(cells[3]), "prompt_s": float(cells[4]), "prompt_tok_s": float(cells[5]),
                     "gen_s": float(cells[6]), "gen_tok_s": float(cells[7]), "total_s": float(cells[8]),
                     "total_tok_s": float(cells[9])})
    if not rows:
        raise ValueError(f"no table rows in llama-batched-bench output:\n{output[-2000:]}")
    return rows


BATCHED_BENCH_ATTEMPTS = 3
"""Runs of ``llama-batched-bench`` before a missing row is an error: it sometimes prints only its first row and exits
0 (seen twice, on 2-core boxes; the next run prints them all)."""


def batched_bench(binary: Path, model: Path, threads: int, n_prompt: int = 64, n_gen: int = 64,
                  n_parallel: tuple[int, ...] = (1, 2, 4, 8), *, unified: bool = False) -> list[dict[str, float | int]]:
    """Run ``llama-batched-bench`` (each of ``n_parallel`` sequences with its own ``n_prompt``-token prompt, then
    ``n_gen`` tokens each) and return its table rows, one per parallel count. ``unified``: every sequence in one KV
    buffer (``-kvu``: each token attends over the cells of all of them, masked, as in the appliance's unsplit
    context); else a KV stream per sequence (``-no-kvu``: each attends over its own, as llama-server's slots)."""
    n_ctx = max(n_parallel) * (n_prompt + n_gen) + 64
    argv = [str(binary), "-m", str(model), "-t", str(threads), "-tb", str(threads), "-c", str(n_ctx),
            "-b", "2048", "-ub", "512", "-ngl", "0", "-npp", str(n_prompt), "-ntg", str(n_gen),
            "-npl", ",".join(str(n) for n in n_parallel), "-kvu" if unified else "-no-kvu"]
    for _attempt in range(BATCHED_BENCH_ATTEMPTS):
        done = subprocess.run(argv, capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            raise RuntimeError(f"llama-batched-bench exited with {done.returncode}:\n"
                               f"{(done.stdout + done.stderr)[-3000:]}")
        rows = parse_batched_bench(done.stdout)
        missing = sorted(set(n_parallel) - {int(row["n_parallel"]) for row in rows})
        if not missing:
            return rows
    raise RuntimeError(f"llama-batched-bench printed no row for {missing} parallel sequences in "
                       f"{BATCHED_BENCH_ATTEMPTS} runs:\n{(done.stdout + done.stderr)[-3000:]}")


def peak_rss_bytes(pid: int) -> int:
    """VmHWM (peak resident set) of a live process, from /proc/<pid>/status."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/{pid}/status has no VmHWM line")


def flash_attention_args(flash_attention: bool | None) -> list[str]:
    """llama.cpp's ``--flash-attn`` argument: ``on`` or ``off``, nothing for None (its own default, ``auto``: on
    where the backend supports it, the CPU included)."""
    if flash_attention is None:
        return []
    return ["--flash-attn", "on" if flash_attention else "off"]


def server_environment() -> dict[str, str]:
    """This process's environment less llama.cpp's ``LLAMA_ARG_*`` variables, which would set options behind the
    benchmark's back (``LLAMA_ARG_FLASH_ATTN`` among them)."""
    return {key: value for key, value in os.environ.items() if not key.startswith("LLAMA_ARG_")}


_FLASH_SETTING = re.compile(r"flash_attn\s*=\s*(\w+)")


def logged_flash_attention(log_text: str) -> str | None:
    """What llama.cpp's log says of flash attention: the setting (its last ``flash_attn = …`` line: ``enabled``,
    ``disabled`` or ``auto``) and, for ``auto``, what it resolved to (``auto -> enabled``); None when not logged."""
    found = _FLASH_SETTING.findall(log_text)
    if not found:
        return None
    setting = found[-1]
    if setting == "auto":
        if "Flash Attention not supported" in log_text:
            return "auto -> disabled"
        if "Flash Attention enabled" in log_text:
            return "auto -> enabled"
    return str(setting)


class LlamaServer:
    """``llama-server`` with ``n_parallel`` slots of ``n_ctx`` tokens each, on a free local port, flash attention
    on, off or (None) left to its default; a context manager that waits for ``/health`` and stops it with
    SIGTERM."""

    def __init__(self, binary: Path, model: Path, n_parallel: int, threads: int, n_ctx: int,
                 log: Path | None = None, flash_attention: bool | None = None,
                 log_verbosity: int | None = None) -> None:
        self.binary = binary
        self.model = model
        self.n_parallel = n_parallel
        self.threads = threads
        self.n_ctx = n_ctx
        self.flash_attention = flash_attention
        self.log_verbosity = log_verbosity
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log = log or Path(tempfile.gettempdir()) / f"llama-server-{self.port}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def argv(self) -> list[str]:
        return [str(self.binary), "-m", str(self.model), "-np", str(self.n_parallel),
                "-c", str(self.n_ctx * self.n_parallel), "-t", str(self.threads), "-tb", str(self.threads),
                "-ngl", "0", "--host", "127.0.0.1", "--port", str(self.port), "--no-webui",
                *flash_attention_args(self.flash_attention),
                *([] if self.log_verbosity is None else ["--log-verbosity", str(self.log_verbosity)])]

    def __enter__(self) -> LlamaServer:
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(self.argv(), stdout=out, stderr=subprocess.STDOUT, env=server_environment())
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def _tail(self) -> str:
        return self.log.read_text(errors="replace")[-2000:] if self.log.exists() else ""

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.base_url + "/health", timeout=2) as response:
                return bool(response.status == 200)
        except OSError:
            return False

    def _wait_healthy(self) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with {self.proc.returncode}:\n{self._tail()}")
            if self._healthy():
                return
            time.sleep(0.1)
        raise RuntimeError(f"llama-server did not answer /health in {START_TIMEOUT_S:.0f} s:\n{self._tail()}")

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def peak_rss_bytes(self) -> int:
        return peak_rss_bytes(self.pid)

    def flash_attention_logged(self) -> str | None:
        """What its log says of flash attention (see :func:`logged_flash_attention`); llama.cpp logs it only from
        ``log_verbosity`` 4 up."""
        return logged_flash_attention(self.log.read_text(errors="replace") if self.log.exists() else "")

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc)


def probe_flash_attention(binary: Path, model: Path, threads: int, flash_attention: bool | None) -> str:
    """What flash attention llama-server runs ``model`` with given ``flash_attention`` (None: its default): a
    llama-server started with ``--log-verbosity 4`` just to read it from its log (the measured servers keep the
    default verbosity, which does not log it, so their timings are not the log's)."""
    log = Path(tempfile.gettempdir()) / f"llama-server-flash-probe-{os.getpid()}.log"
    with LlamaServer(binary, model, n_parallel=1, threads=threads, n_ctx=256, log=log,
                     flash_attention=flash_attention, log_verbosity=4) as server:
        logged = server.flash_attention_logged()
    log.unlink(missing_ok=True)
    if logged is None:
        raise RuntimeError(f"llama-server logged no flash_attn line at --log-verbosity 4 ({binary})")
    return logged


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    build_cmd = sub.add_parser("build", help="build llama-server and llama-batched-bench into the cache")
    build_cmd.add_argument("--cache", type=Path, default=None, help="default: ~/.cache/appliance/llama.cpp-<pin>")
    args = p.parse_args(argv)
    if args.command == "build":
        try:
            bin_dir = build(args.cache)
        except BuildError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        for name in BINARIES:
            print(bin_dir / name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
