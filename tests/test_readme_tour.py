"""The README's "A short tour", every command of it, as a new user runs it (issue #26, "Docs that are wrong today").

The tour is read from README.md itself: each indented block of the section. The appliance is started as the tour
says (``scripts/run.sh`` runs ``.venv/bin/appliance run --config appliance.yaml``) on a copy of the shipped
``appliance.yaml`` in a folder of the test's own (its state folder ``./data`` there, the demo models written on the
way; only the HTTP port moved off 8080, which the commands follow). Then, in the tour's order: each ``$ curl`` with
the real curl, whose output must match the line the README shows (``…`` stands for anything); "Open
http://localhost:8080/" as a GET of that page; the ``nc -U`` session through a socket, each reply line with the
README's kind and fields (values compared unless they are numbers or ``…``: those are the random or the box's);
each ``.venv/bin/appliance`` command as a subprocess from that folder (``/tmp/`` moved into the test's folder, the
vocabulary and template files the last one names copied there), which must exit 0 and print what that command
prints (:data:`CLI_SHAPES`). A command the test does not know fails it: a new tour command needs its shape here."""

from __future__ import annotations

import json
import re
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from appliance.benchmark.servers import free_port

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
BINARY = REPO / ".venv" / "bin" / "appliance"
START_S = 120.0
COMMAND_S = 600.0  # the quick benchmark, on a slow shared box
ELLIPSIS = "…"

CLI_SHAPES: dict[str, list[str]] = {
    "status": [r"(?m)^ledger:$", r"(?m)^models:$", r"(?m)^agents:$", r"(?m)^  a +demo "],
    "register": [r"(?m)^OK schema=lmx-daemon/1$", r"(?m)^OK invoke=REGISTER agent_id=b$",
                 r"(?m)^OK model=demo-wide estimate_bytes=\d+ refcount=1 "],
    "decode": [r"(?m)^OK invoke=DECODE agent_id=b$", r"(?m)^OK prompt_tokens=\d+ generated_tokens=16 ",
               r"(?m)^BEGIN_RESPONSE$", r"(?m)^END_RESPONSE$"],
    "infer": [r"(?m)^\[\d+ prompt \+ \d+ generated tokens, stop=\w+, [\d.]+ ms\]$"],
    "health": [r"^healthy: http http://127\.0\.0\.1:\d+/v1/health ok, socket \S+ speaks MAGN v1"],
    "protocol-check": [r"^protocol ok: 0x0001 "],
    "config": [r"^appliance\.yaml: ok \(2 model\(s\), device auto, admission 90%\)$"],
    "models": [r"(?m)^\S+\.gguf \([\d.]+ MB\)$"],
    "benchmark": [r"(?m)^device class: (low|mid|high) ", r"(?m)^caveats",
                  r"(?m)^HEADLINE: appliance benchmark \(demo, "],
}
"""What each CLI command of the tour prints: patterns its output (stdout and stderr) must hold, by subcommand."""


@dataclass(frozen=True)
class Step:
    """One thing the tour shows: ``kind`` (``curl``, ``open``, ``lines`` or ``cli``), the command (a shell line, a URL,
    or the line session's input lines) and the output it shows."""

    kind: str
    command: str | list[str]
    shown: list[str]


def tour_text(readme: str) -> str:
    start = readme.index("## A short tour\n")
    end = readme.index("\n## ", start + 1)
    return readme[start:end]


def blocks(text: str) -> list[list[str]]:
    """The indented (code) blocks of ``text``, each as its lines without the indent."""
    found: list[list[str]] = []
    current: list[str] = []
    for line in text.splitlines():
        if line.startswith("    "):
            current.append(line[4:])
        elif current:
            found.append(current)
            current = []
    if current:
        found.append(current)
    return found


def joined(lines: list[str]) -> tuple[str, list[str]]:
    """The first command of ``lines`` with its ``\\`` continuations joined, and the lines after it."""
    command = lines[0]
    rest = lines[1:]
    while command.endswith("\\"):
        command = command[:-1] + " " + rest[0].strip()
        rest = rest[1:]
    return command, rest


def steps(readme: str) -> list[Step]:
    """Every step of the tour, in order."""
    text = tour_text(readme)
    found: list[Step] = []
    opened = re.search(r"Open `(http://localhost:8080/[^`]*)` in a browser", text)
    for block in blocks(text):
        if block[0].startswith("$ nc -U"):
            inputs = [line for line in block[1:] if re.match(r"[A-Z]+( |$)", line)
                      and not re.match(r"(OK|ERR|BEGIN_RESPONSE|END_RESPONSE)\b", line)]
            found.append(Step("lines", inputs, block[1:]))
            if opened is not None and not any(step.kind == "open" for step in found):
                found.insert(len(found) - 1, Step("open", opened.group(1), []))
            continue
        rest = block
        while rest:
            if rest[0].startswith("$ "):
                command, rest = joined([rest[0][2:], *rest[1:]])
                shown = []
                while rest and not rest[0].startswith("$ "):
                    shown.append(rest[0])
                    rest = rest[1:]
                assert command.startswith("curl "), f"a tour command the test does not know: {command}"
                found.append(Step("curl", command, shown))
            elif rest[0].startswith(".venv/bin/appliance "):
                command, rest = joined(rest)
                found.append(Step("cli", command.split(" #")[0].strip(), []))
            else:
                raise AssertionError(f"a tour line the test does not know: {rest[0]!r}")
    return found


def test_the_tour_is_read_whole() -> None:
    """The parser sees every step the README shows (so that the run below runs them all)."""
    found = steps(README.read_text())
    kinds = [step.kind for step in found]
    assert kinds[:4] == ["curl", "curl", "open", "lines"] and set(kinds[4:]) == {"cli"}, kinds
    session = found[3].command
    assert session == ["REGISTER a demo", "DECODE a 16 Hello"]
    commands = [str(step.command) for step in found if step.kind == "cli"]
    assert len(commands) == 10 and all(command.startswith(".venv/bin/appliance ") for command in commands)
    assert set(command.split()[1] for command in commands) <= set(CLI_SHAPES)


def shape(line: str) -> re.Pattern[str]:
    """The README's output line as a pattern: ``…`` (with the spaces around it) stands for anything."""
    return re.compile(".*".join(re.escape(part) for part in re.split(r"\s*…\s*", line.strip())))


def same_fields(shown: str, got: str) -> None:
    """A reply line of the README against the real one: its kind, its fields in order, and each value unless the
    README's is a number or ``…``."""
    shown_words = shown.split()
    got_words = got.split()
    assert got_words[:1] == shown_words[:1], (shown, got)
    shown_fields = [word.partition("=") for word in shown_words[1:]]
    got_fields = [word.partition("=") for word in got_words[1:]]
    assert [key for key, _, _ in got_fields] == [key for key, _, _ in shown_fields], (shown, got)
    for (key, _, expected), (_, _, value) in zip(shown_fields, got_fields, strict=True):
        if expected == ELLIPSIS:
            continue
        if re.fullmatch(r"[\d.]+", expected):
            assert re.fullmatch(r"[\d.]+|none", value), (key, shown, got)
        else:
            assert value == expected, (key, shown, got)


def line_session(path: Path, inputs: list[str]) -> list[str]:
    """The replies to ``inputs`` on one connection, as ``nc -U`` prints them (each reply ends at ``END_RESPONSE``, or
    at a first ``ERR`` line)."""
    out: list[str] = []
    with socket.socket(socket.AF_UNIX) as connection:
        connection.settimeout(120)
        connection.connect(str(path))
        reader = connection.makefile("rb")
        for line in inputs:
            connection.sendall(line.encode() + b"\n")
            first = True
            while True:
                reply = reader.readline().decode().rstrip("\n")
                out.append(reply)
                if (first and reply.startswith("ERR")) or reply == "END_RESPONSE":
                    break
                first = False
    return out


def check_session(shown: list[str], got: list[str]) -> None:
    """The session's lines against the README's: inputs are not echoed; an ``…`` line stands for the text."""
    expected = [line for line in shown if not re.match(r"[A-Z]+( |$)", line)
                or re.match(r"(OK|BEGIN_RESPONSE|END_RESPONSE)\b", line)]
    at = 0
    for line in expected:
        if line.startswith(ELLIPSIS):  # the model's text: anything up to END_RESPONSE
            while got[at] != "END_RESPONSE":
                at += 1
            continue
        assert at < len(got), f"the session ended before {line!r}: {got}"
        if line.startswith("OK"):
            same_fields(line, got[at])
        else:
            assert got[at] == line, (line, got[at])
        at += 1
    assert at == len(got), got[at:]


@pytest.fixture
def box(tmp_path: Path) -> Iterator[tuple[Path, int]]:
    """The folder the tour runs in (the shipped appliance.yaml, its port moved; ``./data`` its state folder, with a
    copy of this checkout's demo models when there are any) and the HTTP port; ``appliance run`` answering there."""
    port = free_port()
    text = (REPO / "appliance.yaml").read_text()
    moved = re.sub(r"^  port: 8080( *)", lambda m: f"  port: {port}{m.group(1)}", text, count=1, flags=re.M)
    assert moved != text
    (tmp_path / "appliance.yaml").write_text(moved)
    if (REPO / "data" / "models").is_dir():
        shutil.copytree(REPO / "data" / "models", tmp_path / "data" / "models")
    log = (tmp_path / "run.log").open("wb")
    proc = subprocess.Popen([str(BINARY), "run", "--config", "appliance.yaml"], cwd=tmp_path, stdout=log,
                            stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + START_S
        while True:
            assert proc.poll() is None, (tmp_path / "run.log").read_text()[-3000:]
            try:
                if httpx.get(f"http://127.0.0.1:{port}/v1/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the appliance did not answer"
            time.sleep(0.2)
        yield tmp_path, port
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        log.close()


def run(command: str, folder: Path, port: int) -> subprocess.CompletedProcess[str]:
    command = (command.replace("localhost:8080", f"127.0.0.1:{port}").replace("/tmp/", f"{folder}/")
               .replace(".venv/bin/appliance ", f"{BINARY} ", 1))
    return subprocess.run(["bash", "-c", command], cwd=folder, capture_output=True, text=True, timeout=COMMAND_S)


@pytest.mark.slow
def test_every_command_of_the_tour_works_as_the_readme_shows(box: tuple[Path, int], vendored: Path) -> None:
    folder, port = box
    for name in ("ggml-vocab-qwen2.gguf", "templates/Qwen-Qwen2.5-7B-Instruct.jinja"):
        shutil.copy(vendored / name, folder / Path(name).name)  # the files the last command names, in its folder
    for step in steps(README.read_text()):
        if step.kind == "curl":
            done = run(str(step.command), folder, port)
            assert done.returncode == 0, (step.command, done.stderr)
            assert len(step.shown) == 1
            assert shape(step.shown[0]).fullmatch(done.stdout.strip()), (step.shown[0], done.stdout[:2000])
            json.loads(done.stdout)  # and it is JSON
        elif step.kind == "open":
            page = httpx.get(str(step.command).replace("localhost:8080", f"127.0.0.1:{port}"), timeout=30,
                             follow_redirects=True)
            assert page.status_code == 200 and "<html" in page.text and "/admin/" in str(page.url)
        elif step.kind == "lines":
            assert isinstance(step.command, list)
            check_session(step.shown, line_session(folder / "data" / "appliance.sock", step.command))
        else:
            done = run(str(step.command), folder, port)
            assert done.returncode == 0, (step.command, done.stdout[-2000:], done.stderr[-3000:])
            subcommand = str(step.command).split()[1]
            printed = done.stdout + done.stderr  # a terminal shows both (infer's summary line is on stderr)
            for pattern in CLI_SHAPES[subcommand]:
                assert re.search(pattern, printed), (step.command, pattern, printed[-3000:])
    assert (folder / "m.gguf").stat().st_size > 100 * 10**6 and (folder / "qwen.gguf").is_file()
    assert list((folder / "data" / "benchmarks").glob("appliance-benchmark-*.json"))  # the quick run's result
