"""Build pyfuse3 with cachefs's patch: read() learns the inode when there is no file handle (so
cachefs can use FUSE's no-open mode), and READs of cached blocks are answered in C.

Why: with no-open (the kernel's FUSE_NO_OPEN_SUPPORT, entered when open() answers ENOSYS) the
kernel stops sending OPEN and RELEASE, and keeps the page cache across opens. A warm read then
never reaches Python at all, and a cold one costs LOOKUP + READ instead of LOOKUP + OPEN + READ +
RELEASE. Stock pyfuse3 passes only the file handle to read(), which is 0 in that mode, so the
file cannot be identified; this patch passes the inode instead when the handle is 0 and sets
``pyfuse3.READ_FH_FALLS_BACK_TO_INODE = True`` so cachefs can tell it is there (without it,
cachefs uses ordinary opens and works the same, only slower).

The native READ fast path (``cachefs_fast_read.c`` / ``.h`` beside this file, copied into the
source tree and compiled into the extension, linked with libxxhash for its run-time AVX2
dispatch): a table that cachefs fills with the verified blocks of its RAM tier, consulted by
fuse_read() before the Python handler. A READ whose bytes are all in it is answered with a
pread (block files stay open, a bounded number) + an xxh3 check of every chunk +
fuse_reply_buf, without the GIL-holding handler or a trio task; anything else falls through
unchanged. FUSE_INIT raises the kernel's limit on READs in flight (libfuse's default, 12, is
below one training job's readers; congested, the kernel reads a file a page at a time), and
lowers the largest READ to what the splice pipes hold where they hold less than 1 MiB (no
CAP_SYS_RESOURCE): a large file's READs are then spliced like a small file's. The
session loop then takes the next requests from /dev/fuse (waiting up to 100 µs for each, without
the GIL, 128 at most) without going back to trio for each, as long as they are answered that
way; and a session task back from a Python handler reads a request already queued at once
(poll, then read) instead of taking the read lock and waiting for the fd through trio, at
most 16 times in a row. And ``pyfuse3.cache_listings(True)`` makes OPENDIR replies let the
kernel keep directory listings (FOPEN_CACHE_DIR) until the directory's inode is invalidated:
a warm ``ls -lR`` or ``find`` then stays in the kernel; a cold one (dentries dropped) is
answered in C from the listings cachefs registers (``pyfuse3.fast_listing_*``) when the
binding asks, before an OPENDIR or READDIRPLUS would go to Python.
With ``pyfuse3.fast_passthrough(True)`` before the mount, FUSE_INIT also asks
the kernel for FUSE passthrough (Linux >= 6.9; libfuse 3.14 cannot, so its INIT reply is
captured and extended: see "passthrough" in ``cachefs_fast_read.c``); granted, OPEN and RELEASE
are answered in C and a file whose one block is in the table is read by the kernel from the
block file. ``pyfuse3.fast_peer_answer`` answers another worker's block requests from the same
table (cachefs/peer/server.py hands it the frames received; see "peer answers" in
``cachefs_fast_read.c``); and a READ the table cannot answer, of a file whose one block another
worker owns, is sent to that worker by fuse_read() itself on a connection cachefs handed over
(``pyfuse3.fast_peer_*`` in ``cachefs_peer_reads.pxi``, included after handlers.pxi to make
the coroutine of a READ it hands back; see "peer reads" in ``cachefs_fast_read.c`` and
cachefs/fs/native_peer_reads.py). ``pyfuse3.FAST_READ`` says the patch is there;
the table's Python API is ``pyfuse3.fast_read_*`` (see cachefs/fs/native_reads.py for how cachefs
keeps it coherent). Stock pyfuse3 still works: cachefs then serves every READ in Python.

Usage: python third_party/pyfuse3/build.py [--python PYTHON]
Downloads the pinned pyfuse3 source release from the package index, patches it, and installs it
into PYTHON's environment (default: this interpreter). Idempotent.
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import os
import shutil
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
    (
        "src/pyfuse3/handlers.pxi",
        "                     fuse_file_info *fi):\n    cdef _Container c = _Container()\n"
        "    c.req = req\n    c.size = size\n    c.off = off\n    # cachefs",
        "                     fuse_file_info *fi):\n    cdef _Container c\n"
        "    # cachefs: a READ whose bytes are all in the fast-read table is answered in C.\n"
        "    if cfr_try_read(req, ino, size, off):\n        return\n"
        "    # cachefs: ... and one of a file another worker owns is sent to it from C.\n"
        "    if cfr_try_peer_read(req, ino, fi.fh if fi.fh != 0 else ino, size, off):\n"
        "        return\n    c = _Container()\n"
        "    c.req = req\n    c.size = size\n    c.off = off\n    # cachefs",
    ),
    (
        "src/pyfuse3/handlers.pxi",
        "cdef void fuse_lookup (fuse_req_t req, fuse_ino_t parent,\n"
        "                       const_char *name):\n    cdef _Container c = _Container()\n"
        "    c.req = req\n    c.parent = parent\n",
        "cdef void fuse_lookup (fuse_req_t req, fuse_ino_t parent,\n"
        "                       const_char *name):\n    cdef _Container c\n"
        "    # cachefs: a LOOKUP whose reply cachefs remembered is answered in C.\n"
        "    if cfr_try_lookup(req, parent, name):\n        return\n    c = _Container()\n"
        "    c.req = req\n    c.parent = parent\n",
    ),
    (
        "src/pyfuse3/internal.pxi",
        "        save_retval(None)\n        fuse_session_process_buf(session, &buf)\n"
        "        if py_retval is not None:\n            await py_retval\n",
        "        save_retval(None)\n"
        "        # cachefs: FUSE_INIT may ask for passthrough (cfr_want_passthrough); a READ is\n"
        "        # remembered while it is processed (a spliced reply is written in C).\n"
        "        cfr_process_buf(session, &buf, session_fd)\n"
        "        # cachefs: while requests are answered without Python (the fast-read path),\n"
        "        # take the ones already queued the same way (a bounded batch) before going back\n"
        "        # to trio.\n"
        "        batch = 1\n"
        "        while (py_retval is None and batch < FAST_BATCH\n"
        "               and fast_request_waiting(session_fd)):\n"
        "            res = fuse_session_receive_buf(session, &buf)\n"
        "            if res <= 0:\n                break\n"
        "            batch += 1\n"
        "            cfr_process_buf(session, &buf, session_fd)\n"
        "        cfr_count_batch(batch)\n"
        "        # cachefs: whether this request went to a Python handler (see unwaited below).\n"
        "        after_python = py_retval is not None\n"
        "        if after_python:\n            await py_retval\n",
    ),
    (
        "src/pyfuse3/internal.pxi",
        "    cdef int res\n    cdef fuse_buf buf\n",
        "    cdef int res\n    cdef int batch\n    cdef int unwaited = 0\n"
        "    cdef bint after_python = False\n    cdef fuse_buf buf\n",
    ),
    (
        "src/pyfuse3/internal.pxi",
        "        if not await _wait_fuse_readable():\n            break\n",
        "        # cachefs: after a request that went to Python, a request already waiting\n"
        "        # is read at once, without the read lock and the trip through trio's\n"
        "        # scheduler that waiting for the fd costs (~20 us); at most UNWAITED_IN_A_ROW\n"
        "        # times in a row, so a stream of requests still lets other tasks run. (After\n"
        "        # requests answered in C the loop waits as before: FAST_BATCH bounds those.)\n"
        "        # Every read is preceded by a poll, with nothing run between: /dev/fuse is a\n"
        "        # blocking fd, and another task may have taken the request a wait was woken\n"
        "        # for. The poll counts an ended connection as ready: the read then returns\n"
        "        # ENODEV and libfuse ends the session (else the task would wait and poll for\n"
        "        # ever).\n"
        "        if (after_python and unwaited < UNWAITED_IN_A_ROW\n"
        "                and cfr_fd_ready(session_fd)):\n"
        "            unwaited += 1\n"
        "            cfr_count_unwaited()\n"
        "        else:\n"
        "            unwaited = 0\n"
        "            if not await _wait_fuse_readable():\n                break\n"
        "            if not cfr_fd_ready(session_fd):\n                continue\n",
    ),
    (
        "src/pyfuse3/handlers.pxi",
        "    global py_retval\n    cdef _Container c = _Container()\n    c.req = req\n"
        "    c.size = size\n    c.off = off\n    c.fh = fi.fh\n"
        "    save_retval(fuse_readdirplus_async(c))\n",
        "    global py_retval\n    cdef _Container c\n"
        "    # cachefs: a listing cachefs registered whole (now, if from the start) is answered\n"
        "    # in C.\n"
        "    if cfr_try_readdirplus(req, fi.fh, size, off):\n        return\n"
        "    if (off == 0 and register_listing_now(fi.fh)\n"
        "            and cfr_try_readdirplus(req, fi.fh, size, off)):\n        return\n"
        "    c = _Container()\n    c.req = req\n"
        "    c.size = size\n    c.off = off\n    c.fh = fi.fh\n"
        "    save_retval(fuse_readdirplus_async(c))\n",
    ),
    (
        "src/pyfuse3/handlers.pxi",
        "cdef void fuse_open (fuse_req_t req, fuse_ino_t ino, fuse_file_info *fi):\n"
        "    cdef _Container c = _Container()\n    c.req = req\n",
        "cdef void fuse_open (fuse_req_t req, fuse_ino_t ino, fuse_file_info *fi):\n"
        "    cdef _Container c\n"
        "    # cachefs: with passthrough granted, every OPEN is answered in C.\n"
        "    if cfr_try_open(req, ino, fi):\n        return\n"
        "    c = _Container()\n    c.req = req\n",
    ),
    (
        "src/pyfuse3/handlers.pxi",
        "cdef void fuse_release (fuse_req_t req, fuse_ino_t ino, fuse_file_info *fi):\n"
        "    cdef _Container c = _Container()\n",
        "cdef void fuse_release (fuse_req_t req, fuse_ino_t ino, fuse_file_info *fi):\n"
        "    cdef _Container c\n"
        "    # cachefs: ... and every RELEASE.\n"
        "    if cfr_try_release(req, ino):\n        return\n"
        "    c = _Container()\n",
    ),
    (
        "src/pyfuse3/handlers.pxi",
        "cdef void fuse_opendir (fuse_req_t req, fuse_ino_t ino, fuse_file_info *fi):\n"
        "    cdef _Container c = _Container()\n    c.req = req\n",
        "cdef void fuse_opendir (fuse_req_t req, fuse_ino_t ino, fuse_file_info *fi):\n"
        "    cdef _Container c\n"
        "    # cachefs: OPENDIR of a directory whose listing is registered (now, if cachefs can)\n"
        "    # is answered in C.\n"
        "    if cfr_try_opendir(req, ino, fi):\n        return\n"
        "    if register_listing_now(ino) and cfr_try_opendir(req, ino, fi):\n        return\n"
        "    c = _Container()\n    c.req = req\n",
    ),
    (
        "src/pyfuse3/handlers.pxi",
        "cdef void fuse_releasedir (fuse_req_t req, fuse_ino_t ino, fuse_file_info *fi):\n"
        "    cdef _Container c = _Container()\n",
        "cdef void fuse_releasedir (fuse_req_t req, fuse_ino_t ino, fuse_file_info *fi):\n"
        "    cdef _Container c\n"
        "    # cachefs: nothing to release per directory while listings are served in C.\n"
        "    if cfr_try_releasedir(req):\n        return\n"
        "    c = _Container()\n",
    ),
    (
        "src/pyfuse3/__init__.pyx",
        'include "handlers.pxi"\n',
        'include "cachefs_fast_read.pxi"\ninclude "handlers.pxi"\n'
        'include "cachefs_peer_reads.pxi"\n',
    ),
    (
        "src/pyfuse3/handlers.pxi",
        "    else:\n        ret = fuse_reply_open(c.req, &c.fi)\n\n"
        "    if ret != 0:\n        log.error('fuse_opendir(): ",
        "    else:\n"
        "        cfr_mark_listing(&c.fi)  # cachefs: the kernel may keep the listing\n"
        "        ret = fuse_reply_open(c.req, &c.fi)\n\n"
        "    if ret != 0:\n        log.error('fuse_opendir(): ",
    ),
    (
        "util/build_backend.py",
        "c_sources = ['src/pyfuse3/__init__.pyx']",
        "c_sources = ['src/pyfuse3/__init__.pyx', 'src/pyfuse3/cachefs_fast_read.c']",
    ),
    (
        "util/build_backend.py",
        "    link_args.append('-lpthread')\n",
        "    link_args.append('-lpthread')\n"
        "    link_args.append('-lxxhash')  # cachefs: xxh3 with run-time AVX2 dispatch\n",
    ),
    (
        "src/pyfuse3/internal.pxi",
        "        if res == -errno.EINTR:\n            continue\n",
        "        # cachefs: with more processes serving one connection (cachefs/fs/serving.py)\n"
        "        # /dev/fuse is non-blocking, and another process may have read the request\n"
        "        # this one was woken for: wait again.\n"
        "        if res == -errno.EINTR or res == -errno.EAGAIN:\n            continue\n",
    ),
    (
        "src/pyfuse3/handlers.pxi",
        "    conn.want &= ~(<unsigned> FUSE_CAP_READDIRPLUS_AUTO)\n",
        "    conn.want &= ~(<unsigned> FUSE_CAP_READDIRPLUS_AUTO)\n"
        "    cfr_init_connection(conn)  # cachefs: more READs in flight (readahead)\n",
    ),
]
#: Files of the fast path, copied from beside this script into the pyfuse3 source tree.
FAST_READ_FILES = (
    "cachefs_fast_read.c",
    "cachefs_fast_read.h",
    "cachefs_fast_read.pxi",
    "cachefs_peer_reads.pxi",
)


def patch_id() -> str:
    """A digest of the whole patch (the text replacements and the fast-path files): built into
    the module as ``pyfuse3.CACHEFS_PATCH``, so a changed patch is rebuilt by the next setup."""
    here = os.path.dirname(os.path.abspath(__file__))
    digest = hashlib.sha256(repr(PATCHES).encode())
    for name in FAST_READ_FILES:
        with open(os.path.join(here, name), "rb") as f:
            digest.update(f.read())
    return digest.hexdigest()[:16]


def is_installed(python: str) -> bool:
    probe = (
        "import pyfuse3, sys\n"
        f"patched = getattr(pyfuse3, 'CACHEFS_PATCH', None) == {patch_id()!r}\n"
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
        here = os.path.dirname(os.path.abspath(__file__))
        for name in FAST_READ_FILES:
            shutil.copy(os.path.join(here, name), os.path.join(source, "src", "pyfuse3", name))
        for relative, original, replacement in PATCHES:
            path = os.path.join(source, relative)
            with open(path) as f:
                text = f.read()
            if text.count(original) != 1:
                raise SystemExit(f"cannot patch {relative}: upstream text changed")
            with open(path, "w") as f:
                f.write(text.replace(original, replacement))
        with open(os.path.join(source, "src", "pyfuse3", "__init__.pyx"), "a") as f:
            f.write(
                f"\n# cachefs patch: which one (third_party/pyfuse3/build.py patch_id).\n"
                f"CACHEFS_PATCH = {patch_id()!r}\n"
            )
        # The shipped C file is generated from the .pyx; remove it so Cython regenerates it.
        os.remove(os.path.join(source, "src", "pyfuse3", "__init__.c"))
        subprocess.run(
            [args.python, "-m", "pip", "install", "-q", "--force-reinstall", "--no-deps", source],
            check=True,
        )
    if not is_installed(args.python):
        raise SystemExit("patched pyfuse3 did not install correctly")
    print(f"installed pyfuse3 {VERSION} with the cachefs patch {patch_id()}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
