"""The peers' own virtual environments, made on first use by the benchmarks that compare with them
(each peer pins versions of torch that surgery's environment does not have). Both folders are
git-ignored; delete one to have it made again."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

# folder -> pip installs, in order (llm-compressor pins torch <= 2.14.0; auto-round 0.16 runs on 2.14.1)
VENVS: dict[str, tuple[list[str], ...]] = {
    "llmcompressor": (
        # the CPU build: from PyTorch's index, or a mirror of it (the index unreachable: tried once, quickly)
        [
            "torch==2.13.0+cpu",
            "--extra-index-url",
            "https://download.pytorch.org/whl/cpu",
            "--retries",
            "0",
            "--timeout",
            "5",
        ],
        ["llmcompressor==0.14.0.1"],
    ),
    "auto_round": (["torch==2.14.1", "auto-round==0.16.1"],),
    # llama.cpp through llama-cpp-python, built from its source distribution (PyPI has no wheel):
    # for this machine's CPU (GGML_NATIVE), without the multimodal library (llama_cpp_runner.py
    # turns llama.cpp's extra buffer types off: see there)
    "llama_cpp": (
        ["numpy", "gguf==0.19.0"],
        ["llama-cpp-python==0.3.36", "--no-binary", "llama-cpp-python", "--no-cache-dir"],
    ),
}
ENVIRONMENT: dict[str, dict[str, str]] = {"llama_cpp": {"CMAKE_ARGS": "-DLLAVA_BUILD=OFF -DGGML_BLAS=OFF"}}


@functools.cache  # checked once a run
def peer_python(peer: str) -> Path:
    """The interpreter of ``benchmarks/.venv-<peer>``, made with :data:`VENVS`'s installs when
    absent; one that exists but cannot import ``peer`` (an install cut short) is refused."""
    folder = HERE / f".venv-{peer}"
    python = folder / "bin" / "python"
    if not python.exists():
        make(folder, VENVS[peer], ENVIRONMENT.get(peer, {}))
    found = subprocess.run([str(python), "-c", f"import {peer}"], capture_output=True, text=True, check=False)
    if found.returncode != 0:
        raise RuntimeError(f"{folder} cannot import {peer} (an install cut short?): delete it to have it made again")
    return python


def make(folder: Path, installs: tuple[list[str], ...], environment: dict[str, str] | None = None) -> None:
    """A fresh venv in ``folder`` (a dangling link there replaced) with ``installs`` run in order,
    ``environment`` added to the installer's (a source build's settings); says how long it took."""
    pins = ", ".join(package for step in installs for package in step if "==" in package)
    print(f"making {folder} ({pins}) ...", flush=True)
    if folder.is_symlink():  # a link left to a venv that is gone
        folder.unlink()
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "venv", str(folder)], check=True)
    env = {**os.environ, **(environment or {})}
    for packages in installs:
        subprocess.run([str(folder / "bin" / "python"), "-m", "pip", "install", "-q", *packages], check=True, env=env)
    print(f"made {folder} in {time.perf_counter() - start:.0f} s", flush=True)


LLAMA_CPP_TOOLS = ("llama-imatrix", "llama-quantize")


@functools.cache
def llama_cpp_tools() -> Path:
    """The folder of llama.cpp's ``llama-imatrix`` and ``llama-quantize``, built with cmake from the
    llama.cpp inside the same llama-cpp-python source distribution (its Python binding cannot pass
    an importance matrix to the quantizer) into ``benchmarks/.venv-llama_cpp/tools`` on first use;
    says how long the build took."""
    python = peer_python("llama_cpp")
    tools = python.parent.parent / "tools"
    built = tools / "build" / "bin"  # beside the shared libraries they link
    if all((built / name).exists() for name in LLAMA_CPP_TOOLS):
        return built
    source = tools / "source"
    start = time.perf_counter()
    if not source.exists():
        download = tools / "download"
        version = next(p for step in VENVS["llama_cpp"] for p in step if p.startswith("llama-cpp-python=="))
        pip = [str(python), "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:", "-d", str(download)]
        subprocess.run([*pip, version], check=True)
        archive = next(download.glob("llama_cpp_python-*.tar.gz"))
        subprocess.run(["tar", "-xzf", str(archive), "-C", str(download)], check=True)
        next(download.glob("llama_cpp_python-*/vendor/llama.cpp")).rename(source)
    flags = ["-DLLAMA_CURL=OFF", "-DGGML_BLAS=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF"]
    subprocess.run(["cmake", "-S", str(source), "-B", str(tools / "build"), "-G", "Ninja", *flags], check=True)
    subprocess.run(["cmake", "--build", str(tools / "build"), "--target", *LLAMA_CPP_TOOLS], check=True)
    print(f"built llama.cpp's {', '.join(LLAMA_CPP_TOOLS)} in {time.perf_counter() - start:.0f} s", flush=True)
    return built
