"""The committed CSI stubs are what grpcio-tools makes from the vendored csi.proto (the
regeneration command of cachefs/csi/proto/README.md), so the proto and the code never drift."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
PROTO = Path("cachefs/csi/proto/csi.proto")
GENERATED = ("csi_pb2.py", "csi_pb2_grpc.py")


def test_the_committed_stubs_are_generated_from_the_vendored_proto(tmp_path):
    (tmp_path / PROTO.parent).mkdir(parents=True)
    shutil.copy(ROOT / PROTO, tmp_path / PROTO)
    subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", "-I", ".", "--python_out=.",
         "--grpc_python_out=.", str(PROTO)],
        cwd=tmp_path, check=True,
    )  # fmt: skip
    for name in GENERATED:
        fresh = (tmp_path / PROTO.parent / name).read_text()
        assert fresh == (ROOT / PROTO.parent / name).read_text(), f"{name}: regenerate it"


def test_the_vendored_proto_is_the_csi_v1_spec_with_its_license():
    text = (ROOT / PROTO).read_text()
    assert "package csi.v1;" in text
    assert "rpc NodePublishVolume" in text and "rpc GetPluginInfo" in text
    license_text = (ROOT / PROTO.parent / "LICENSE").read_text()
    assert "Apache License" in license_text and "Version 2.0" in license_text
    assert "v1.12.0" in (ROOT / PROTO.parent / "README.md").read_text()
