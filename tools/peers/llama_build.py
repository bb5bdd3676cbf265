"""Build ``llama-server`` from the llama.cpp sources vendored in the ``llama-cpp-python`` sdist.

::

    nice -n 19 python -m tools.peers.llama_build              # download, configure, build (-j1)
    python -m tools.peers.llama_build --print                 # the binary's path, if built
    python -m tools.peers.llama_build --variant portable      # AVX-512/VNNI/BF16 on, AMX off

No binary is downloaded: ``pip download --no-deps --no-binary :all: llama-cpp-python``
fetches the source distribution (PyPI's ordinary client) into the cache folder
``~/.cache/streamscope/llama`` (``$XDG_CACHE_HOME`` honoured), outside the repository;
it is unpacked there and its ``vendor/llama.cpp`` is configured with cmake and built,
server target only, into ``build-<variant>``.

Two variants (``--variant``):

* ``native``: ``-DGGML_NATIVE=ON``, the compiler's ``-march=native``. On some machines of
  this kind its AMX kernels die with a general protection fault at the first batch.
* ``portable`` (the default): ``-DGGML_NATIVE=OFF`` with AVX, AVX2, FMA, F16C, AVX-512,
  AVX-512 VNNI and AVX-512 BF16 on and AMX off: the build that runs on every machine of
  this kind. ``build.json`` beside the binary records the variant, the sdist's version and
  the cmake options, so a side-by-side can say which build ran (``tools.peers.sidebyside``).

The build takes 10-20 minutes on 2 shared cores; ``--jobs`` (default 1) sets cmake's -j.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

PACKAGE = "llama-cpp-python"
COMMON = ["-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_CURL=OFF",
          "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=ON",
          "-DGGML_OPENMP=OFF"]
VARIANTS: dict[str, list[str]] = {
    "native": ["-DGGML_NATIVE=ON"],
    "portable": ["-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON",
                 "-DGGML_F16C=ON", "-DGGML_AVX512=ON", "-DGGML_AVX512_VNNI=ON",
                 "-DGGML_AVX512_BF16=ON", "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF",
                 "-DGGML_AMX_BF16=OFF"],
}
DEFAULT_VARIANT = "portable"


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "streamscope" / "llama"


def build_dir(variant: str, root: Path | None = None) -> Path:
    return (root or cache_dir()) / f"build-{variant}"


def server_binary(variant: str, root: Path | None = None) -> Path:
    return build_dir(variant, root) / "bin" / "llama-server"


def built_variant(root: Path | None = None) -> tuple[Path, dict[str, object]] | None:
    """The first built server (portable before native) and its ``build.json``; None if
    neither is built."""
    for variant in (DEFAULT_VARIANT, *(v for v in VARIANTS if v != DEFAULT_VARIANT)):
        binary = server_binary(variant, root)
        record = build_dir(variant, root) / "build.json"
        if binary.is_file() and record.is_file():
            return binary, json.loads(record.read_text())
    return None


def download_sdist(root: Path) -> Path:
    """The sdist's tarball in ``root`` (downloaded once)."""
    root.mkdir(parents=True, exist_ok=True)
    found = sorted(root.glob("llama_cpp_python-*.tar.gz"))
    if not found:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary",
                        ":all:", "--dest", str(root), PACKAGE], check=True)
        found = sorted(root.glob("llama_cpp_python-*.tar.gz"))
    if not found:
        raise FileNotFoundError(f"pip download left no llama_cpp_python sdist in {root}")
    return found[-1]


def unpack(tarball: Path) -> Path:
    """The vendored llama.cpp folder of ``tarball`` (unpacked once, beside it)."""
    top = tarball.parent / tarball.name.removesuffix(".tar.gz")
    source = top / "vendor" / "llama.cpp"
    if not (source / "CMakeLists.txt").is_file():
        with tarfile.open(tarball) as archive:
            archive.extractall(tarball.parent, filter="data")
    if not (source / "CMakeLists.txt").is_file():
        raise FileNotFoundError(f"no vendor/llama.cpp/CMakeLists.txt in {tarball}")
    return source


def cmake_commands(source: Path, build: Path, variant: str, jobs: int) -> list[list[str]]:
    """The configure and build commands (the build of the server target only)."""
    return [["cmake", "-S", str(source), "-B", str(build), *COMMON, *VARIANTS[variant]],
            ["cmake", "--build", str(build), "--target", "llama-server", "-j", str(jobs)]]


def build(variant: str, jobs: int, root: Path | None = None) -> Path:
    root = root or cache_dir()
    tarball = download_sdist(root)
    source = unpack(tarball)
    target = build_dir(variant, root)
    for command in cmake_commands(source, target, variant, jobs):
        subprocess.run(command, check=True)
    binary = server_binary(variant, root)
    if not binary.is_file():
        raise FileNotFoundError(f"the build left no {binary}")
    record = {"variant": variant, "sdist": tarball.name,
              "cmake_options": COMMON + VARIANTS[variant]}
    (target / "build.json").write_text(json.dumps(record, indent=2))
    return binary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variant", choices=sorted(VARIANTS), default=DEFAULT_VARIANT)
    parser.add_argument("--jobs", type=int, default=1, help="cmake --build -j (default 1)")
    parser.add_argument("--root", type=Path, default=None,
                        help="cache folder (default ~/.cache/streamscope/llama)")
    parser.add_argument("--print", action="store_true",
                        help="print the built binary and its build record; build nothing")
    args = parser.parse_args(argv)
    if args.print:
        found = built_variant(args.root)
        if found is None:
            print("no llama-server built: python -m tools.peers.llama_build", file=sys.stderr)
            return 1
        print(found[0], json.dumps(found[1]))
        return 0
    print(build(args.variant, args.jobs, args.root))
    return 0


if __name__ == "__main__":
    sys.exit(main())
