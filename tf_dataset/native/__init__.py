"""tf_dataset's native kernels (``cachefs_ops.cc``): short-circuit reads verified in C++.

    python -m tf_dataset.native          # build for the installed TensorFlow (scripts/setup.sh)

Why C++: read in Python, a short-circuited file costs a ``tf.numpy_function`` call's share, the
GIL, and a second copy of every byte into the output tensor; on 2 cores that capped tf_dataset
at ~10,000 files/s where ``tf.io.read_file`` reads 27,000 (bench/README.md, "tf_bench"). The
kernel reads each block file straight into the output tensor and checks its xxh3_64 there.

The library is compiled against the TensorFlow installed (its headers and
``libtensorflow_framework``), so its file name carries TensorFlow's version and a hash of the
source: after an upgrade of either it is simply not found until rebuilt, and tf_dataset reads
in Python meanwhile (with a warning), never with a library built for another version. Needs
g++ and xxhash's header and library (Debian: ``libxxhash-dev``).
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys

import xxhash

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cachefs_ops.cc")


class NativeUnavailable(RuntimeError):
    """The kernels cannot be loaded (not built for this TensorFlow, or failed to load)."""


def library_path(tf_version: str | None = None) -> str:
    """Where the library for ``tf_version`` (default: the installed TensorFlow) and this
    version of the source is built."""
    if tf_version is None:
        import tensorflow as tf

        tf_version = tf.__version__
    with open(SOURCE, "rb") as f:
        source_hash = xxhash.xxh3_64_hexdigest(f.read())[:12]
    return os.path.join(os.path.dirname(SOURCE), f"_cachefs_ops-{source_hash}-tf{tf_version}.so")


def compile_command(output: str) -> list[str]:
    import tensorflow as tf

    return [
        os.environ.get("CXX", "g++"),
        "-shared",
        "-fPIC",
        "-O2",
        "-Wall",
        # TensorFlow's headers as system headers: their warnings are not ours to fix.
        *(
            "-isystem" + flag[2:] if flag.startswith("-I") else flag
            for flag in tf.sysconfig.get_compile_flags()
        ),
        SOURCE,
        "-o",
        output,
        *tf.sysconfig.get_link_flags(),
        "-lxxhash",
    ]


def build(force: bool = False) -> str:
    """Compile the library for the installed TensorFlow (if not built yet); its path."""
    output = library_path()
    if os.path.exists(output) and not force:
        return output
    partial = f"{output}.{os.getpid()}.tmp"
    try:
        subprocess.run(compile_command(partial), check=True)
        os.replace(partial, output)  # never a half-written library under the final name
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    load.cache_clear()
    return output


@functools.lru_cache(maxsize=1)
def load():
    """The loaded op module (``cachefs_read_files``, ``cachefs_read_tf_record_block``).

    Raises :class:`NativeUnavailable` saying why, and how to build it."""
    import tensorflow as tf

    path = library_path()
    if not os.path.exists(path):
        raise NativeUnavailable(
            f"tf_dataset's native kernels are not built for TensorFlow {tf.__version__} "
            f"({path} is missing): run `python -m tf_dataset.native`"
        )
    try:
        return tf.load_op_library(path)
    except (tf.errors.NotFoundError, OSError) as exc:
        raise NativeUnavailable(f"loading {path} failed: {exc}") from exc


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m tf_dataset.native", description=__doc__)
    parser.add_argument("--force", action="store_true", help="rebuild even if built")
    args = parser.parse_args(argv)
    try:
        path = build(force=args.force)
        load()
    except (OSError, subprocess.CalledProcessError, NativeUnavailable) as exc:
        print(f"tf_dataset.native: build failed: {exc}", file=sys.stderr)
        return 1
    print(f"tf_dataset.native: {path}", file=sys.stderr)
    return 0
