"""Whether the installed llama-cpp-python can offload layers to a GPU (``llama_supports_gpu_offload()``): what the
daemon asks before it places a model's layers, and the check ``scripts/setup.sh`` runs after a CUDA build
(``python -m appliance.engine.gpubuild --version X``: one line, exit 0 when the build offloads, 1 when not)."""

from __future__ import annotations

import argparse
import sys


def offload_supported() -> bool:
    """Whether this llama.cpp build can offload layers to a GPU (False for a CPU build)."""
    from appliance.engine.bindings import llama_cpp

    return bool(llama_cpp.llama_supports_gpu_offload())


def installed_version() -> str:
    import llama_cpp

    return str(llama_cpp.__version__)


def verdict(*, offloads: bool, installed: str, pinned: str | None) -> tuple[bool, str]:
    """Whether the build is what a GPU set-up needs (``pinned``: the version it must be, None: any), and the one line
    that says so."""
    if pinned is not None and installed != pinned:
        return False, f"llama-cpp-python {installed} is installed, not the pinned {pinned}"
    if not offloads:
        return False, (f"llama-cpp-python {installed} cannot offload to a GPU: llama_supports_gpu_offload() is false "
                       "(built without GPU support: APPLIANCE_GPU=cuda scripts/setup.sh builds it with CUDA)")
    return True, f"llama-cpp-python {installed} offloads to a GPU: llama_supports_gpu_offload() is true"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m appliance.engine.gpubuild",
                                     description="Say whether the installed llama-cpp-python offloads to a GPU.")
    parser.add_argument("--version", help="the version it must be (scripts/setup.sh passes the pinned one)")
    parser.add_argument("--quiet", action="store_true", help="print nothing: the exit status says it")
    args = parser.parse_args(argv)
    ok, line = verdict(offloads=offload_supported(), installed=installed_version(), pinned=args.version)
    if not args.quiet:
        print(line, file=sys.stdout if ok else sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
