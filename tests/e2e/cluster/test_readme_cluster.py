"""README.md's "try it on one machine" cluster block, run as written: a coordinator and two
`cachefs worker`s on one machine with the README's own options (no --metrics, no --ram-dir),
a dataset added and preloaded, every file read through a mount, everything stopped.

The block is read out of README.md, so a change there changes (or breaks) this test. Only what
must be replaced is: the store (the README's `s3://bucket/imagenet` at `http://127.0.0.1:9000`
becomes a moto bucket and endpoint), the three ports (free ones: tests run in parallel), and the
`/tmp/cachefs-local` directory (the test's own). Each of these must occur in the block.
"""

from __future__ import annotations

import hashlib
import os
import random
import re
import shutil
import signal
import subprocess
import sys

from cachefs.host import mounts_at
from cachefs.settings import default_ram_dir
from tests.fakes.moto import free_port
from tests.waiting import WAIT_S, wait_for
from tests.worker_process import REPO_ROOT, force_unmount, live_process_group, log_tail

README = os.path.join(REPO_ROOT, "README.md")
MARKER = "`tests/e2e/cluster/test_readme_cluster.py` runs this block"


def readme_block() -> str:
    """The first fenced code block after MARKER, joined lines and all."""
    with open(README) as f:
        text = f.read()
    assert MARKER in text, "README.md lost its one-machine cluster block"
    after = text[text.index(MARKER) :]
    match = re.search(r"```bash\n(.*?)```", after, re.S)
    assert match, "no ```bash block after the marker"
    return match.group(1)


def _substitute(block: str, replacements: dict[str, str]) -> str:
    for old, new in replacements.items():
        assert old in block, f"the README block no longer contains {old!r}"
        block = block.replace(old, new)
    return block


def test_the_readmes_one_machine_cluster_runs_as_written(moto_s3, tmp_path):
    rng = random.Random(10)
    files = {f"train/img-{i:02}.jpg": rng.randbytes(rng.randint(1, 200_000)) for i in range(24)}
    files["val/v.jpg"] = rng.randbytes(5000)
    bucket = moto_s3.make_bucket()
    for key, data in files.items():
        moto_s3.put(bucket, f"imagenet/{key}", data)

    base = str(tmp_path / "local")
    script = _substitute(
        readme_block(),
        {
            "s3://bucket/imagenet": f"s3://{bucket}/imagenet",
            "http://127.0.0.1:9000": moto_s3.endpoint,
            "127.0.0.1:7700": f"127.0.0.1:{free_port()}",
            "127.0.0.1:7701": f"127.0.0.1:{free_port()}",
            "127.0.0.1:7702": f"127.0.0.1:{free_port()}",
            "/tmp/cachefs-local": base,
        },
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("CACHEFS_")}
    env.update(moto_s3.env)
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env["PATH"]  # `cachefs`
    env["PYTHONPATH"] = REPO_ROOT
    out_path, err_path = tmp_path / "stdout", tmp_path / "stderr"
    mounts = [os.path.join(base, "mnt-n1"), os.path.join(base, "mnt-n2")]
    with open(out_path, "w") as out, open(err_path, "w") as err:
        shell = subprocess.Popen(
            ["bash", "-e", "-c", script], env=env, stdout=out, stderr=err, start_new_session=True
        )
    try:
        try:
            rc = shell.wait(timeout=4 * WAIT_S)
        except subprocess.TimeoutExpired:
            rc = None
        assert rc == 0, f"rc {rc}\n{log_tail(str(out_path))}\n{log_tail(str(err_path))}"
        wait_for(lambda: live_process_group(shell.pid) == [], "the README's processes to stop")

        stdout = out_path.read_text()
        read = dict(
            (os.path.relpath(path, os.path.join(mounts[0], "imagenet")), digest)
            for digest, path in re.findall(r"^([0-9a-f]{32})  (.+)$", stdout, re.M)
        )
        expected = {
            key: hashlib.md5(data).hexdigest()
            for key, data in files.items()
            if key.startswith("train/")
        }
        assert read == expected  # every byte of every file, through n1's mount
        assert "100.0%" in stdout, stdout  # `cachefs locality`: all of it cached
        stderr = err_path.read_text()
        assert "Traceback" not in stderr, stderr
        assert "Address already in use" not in stderr
        for mount in mounts:  # `cachefs down` returned once each worker had unmounted
            assert mounts_at(mount) == []
    finally:
        if live_process_group(shell.pid):
            os.killpg(shell.pid, signal.SIGKILL)
        for mount in mounts:
            force_unmount(mount)
        for node in ("n1", "n2"):
            shutil.rmtree(default_ram_dir(os.path.join(base, node)), ignore_errors=True)
