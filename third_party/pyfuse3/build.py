"""Build pyfuse3 with cachefs's one-line patch: read() learns the inode when there is no file
handle, so cachefs can use FUSE's no-open mode.

Why: with no-open (the kernel's FUSE_NO_OPEN_SUPPORT, entered when open() answers ENOSYS) the
kernel stops sending OPEN and RELEASE, and keeps the page cache across opens. A warm read then
never reaches Python at all, and a cold one costs LOOKUP + READ instead of LOOKUP + OPEN + READ +
RELEASE. Stock pyfuse3 passes only the file handle to read(), which is 0 in that mode, so the
file cannot be identified; this patch passes the inode instead when the handle is 0 and sets
``pyfuse3.READ_FH_FALLS_BACK_TO_INODE = True`` so cachefs can tell it is there (without it,
cachefs uses ordinary opens and works the same, only slower).

Usage: python third_party/pyfuse3/build.py [--python PYTHON]
Downloads the pinned pyfuse3 source release from the package index, patches it, and installs it
into PYTHON's environment (default: this interpreter). Idempotent.
"""

from __future__ import annotations

import argparse
import glob
import os
import subprocess
import sys
import tarfile
import tempfile

VERSION = "3.5.0"

# (file, exact original text, replacement) — the build fails loudly if upstream changed.
PATCHES = [
    (
        "src/pyfuse3/handlers.pxi",
        "    c.size = size\n    c.off = off\n    c.fh = fi.fh\n    save_retval(fuse_read_async(c))",
        "    c.size = size\n    c.off = off\n"
        "    # cachefs: in no-open mode fi.fh is 0; hand read() the inode instead.\n"
        "    c.fh = fi.fh if fi.fh != 0 else ino\n    save_retval(fuse_read_async(c))",
    ),
    (
        "src/pyfuse3/__init__.pyx",
        "ROOT_INODE = FUSE_ROOT_ID\n",
        "ROOT_INODE = FUSE_ROOT_ID\n"
        "# cachefs patch: read() gets the inode when the file handle is 0 (no-open mode).\n"
        "READ_FH_FALLS_BACK_TO_INODE = True\n",
    ),
]


def is_installed(python: str) -> bool:
    probe = (
        "import pyfuse3, sys\n"
        "patched = getattr(pyfuse3, 'READ_FH_FALLS_BACK_TO_INODE', False)\n"
        f"sys.exit(0 if patched and pyfuse3.__version__ == {VERSION!r} else 1)"
    )
    return subprocess.run([python, "-c", probe], capture_output=True).returncode == 0


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--python", default=sys.executable)
    args = parser.parse_args()
    if is_installed(args.python):
        print(f"pyfuse3 {VERSION} (cachefs patch) already installed", file=sys.stderr)
        return 0
    with tempfile.TemporaryDirectory() as work:
        subprocess.run(
            [args.python, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
             "-d", work, f"pyfuse3=={VERSION}"],
            check=True,
        )  # fmt: skip
        (sdist,) = glob.glob(os.path.join(work, "pyfuse3-*.tar.gz"))
        with tarfile.open(sdist) as tar:
            tar.extractall(work, filter="data")
        source = os.path.join(work, f"pyfuse3-{VERSION}")
        for relative, original, replacement in PATCHES:
            path = os.path.join(source, relative)
            with open(path) as f:
                text = f.read()
            if text.count(original) != 1:
                raise SystemExit(f"cannot patch {relative}: upstream text changed")
            with open(path, "w") as f:
                f.write(text.replace(original, replacement))
        # The shipped C file is generated from the .pyx; remove it so Cython regenerates it.
        os.remove(os.path.join(source, "src", "pyfuse3", "__init__.c"))
        subprocess.run(
            [args.python, "-m", "pip", "install", "-q", "--force-reinstall", "--no-deps", source],
            check=True,
        )
    if not is_installed(args.python):
        raise SystemExit("patched pyfuse3 did not install correctly")
    print(f"installed pyfuse3 {VERSION} with the cachefs read-inode patch", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
