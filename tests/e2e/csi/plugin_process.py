"""A real ``cachefs csi`` node plugin process for the tests, and a gRPC client of it.

The plugin is started with the command line a Kubernetes DaemonSet runs (k8s/base/csi.yaml)
and called over its unix socket, as the kubelet and node-driver-registrar call it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid

import grpc

from cachefs.csi.proto import csi_pb2, csi_pb2_grpc
from tests.waiting import WAIT_S
from tests.worker_process import REPO_ROOT, log_tail

AccessMode = csi_pb2.VolumeCapability.AccessMode


class PluginProcess:
    def __init__(self, base_dir: str, *, state_dir: str, kubelet_dir: str, node: str = "node-1"):
        self.base_dir = base_dir
        self.socket = os.path.join(base_dir, "csi.sock")
        self.endpoint = f"unix://{self.socket}"
        self.log_path = os.path.join(base_dir, "plugin.log")
        self.command = [
            sys.executable, "-m", "cachefs", "--state", state_dir,
            "csi", "--endpoint", self.endpoint, "--node", node, "--kubelet-dir", kubelet_dir,
        ]  # fmt: skip
        self.proc: subprocess.Popen | None = None
        self.channel: grpc.Channel | None = None

    def start(self) -> PluginProcess:
        os.makedirs(self.base_dir, exist_ok=True)
        env = {
            **os.environ,
            "PYTHONPATH": REPO_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
        }
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                self.command, env=env, stdout=log, stderr=subprocess.STDOUT
            )
        self.channel = grpc.insecure_channel(self.endpoint)
        try:
            grpc.channel_ready_future(self.channel).result(timeout=WAIT_S)
        except grpc.FutureTimeoutError:
            self.kill()
            raise RuntimeError(f"the plugin did not serve in {WAIT_S}s:\n{self.log()}") from None
        return self

    @property
    def identity(self) -> csi_pb2_grpc.IdentityStub:
        return csi_pb2_grpc.IdentityStub(self.channel)

    @property
    def node(self) -> csi_pb2_grpc.NodeStub:
        return csi_pb2_grpc.NodeStub(self.channel)

    def log(self) -> str:
        return log_tail(self.log_path)

    def terminate(self) -> int:
        """SIGTERM, as the kubelet stops the container; the exit status."""
        self.channel.close()
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=WAIT_S)

    def kill(self) -> None:
        if self.channel is not None:
            self.channel.close()
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=WAIT_S)


def new_target(kubelet_dir: str, volume: str = "pv") -> str:
    """A target path laid out as the kubelet's: ``pods/<uid>/volumes/kubernetes.io~csi/<pv>/
    mount``, its parent created (the CO's job), the target itself not (the plugin's)."""
    parent = os.path.join(
        kubelet_dir, "pods", str(uuid.uuid4()), "volumes", "kubernetes.io~csi", volume
    )
    os.makedirs(parent)
    return os.path.join(parent, "mount")


def capability(
    mode: int = AccessMode.MULTI_NODE_READER_ONLY,
    *,
    block: bool = False,
    flags: tuple[str, ...] = (),
) -> csi_pb2.VolumeCapability:
    """A volume capability: a PersistentVolume with ``accessModes: [ReadOnlyMany]`` by default."""
    if block:
        access = {"block": csi_pb2.VolumeCapability.BlockVolume()}
    else:
        access = {"mount": csi_pb2.VolumeCapability.MountVolume(mount_flags=list(flags))}
    return csi_pb2.VolumeCapability(access_mode=AccessMode(mode=mode), **access)


def publish_request(
    target: str,
    volume_id: str = "imagenet",
    *,
    context: dict[str, str] | None = None,
    capability_: csi_pb2.VolumeCapability | None = None,
    readonly: bool = True,
) -> csi_pb2.NodePublishVolumeRequest:
    """What the kubelet sends for a pod using a PersistentVolume ``volume_id`` (its
    ``volumeHandle``), with the pod information the CSIDriver's podInfoOnMount adds."""
    pod_info = {
        "csi.storage.k8s.io/pod.name": "train-0",
        "csi.storage.k8s.io/pod.namespace": "ml",
        "csi.storage.k8s.io/pod.uid": "0f3c9a52-0000-4000-8000-000000000000",
        "csi.storage.k8s.io/serviceAccount.name": "default",
    }
    return csi_pb2.NodePublishVolumeRequest(
        volume_id=volume_id,
        target_path=target,
        volume_capability=capability() if capability_ is None else capability_,
        readonly=readonly,
        volume_context={**pod_info, **(context or {})},
    )


def unpublish_request(target: str, volume_id: str = "imagenet"):
    return csi_pb2.NodeUnpublishVolumeRequest(volume_id=volume_id, target_path=target)
