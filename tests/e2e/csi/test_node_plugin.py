"""The CSI node plugin (``cachefs csi``) called over its real unix socket, as the kubelet calls
it, with real bind mounts of a real ``cachefs up`` worker's FUSE mount (one dataset from moto's
S3 server, one from a ``file://`` directory).

Shown here: the Identity and Node services answer per the CSI v1 spec; a published volume is a
read-only (``ro,nosuid,nodev``) bind of ``<mount>/<dataset>`` that reads byte-exact and refuses
writes with EROFS; publish and unpublish are idempotent; each malformed request gets its status
code and one-line reason and changes nothing; a worker that is down is UNAVAILABLE, a dataset it
does not serve NOT_FOUND; after a worker restart a republish brings a dead volume back, also in
a slave view of it (what a pod's HostToContainer volumeMount is); SIGTERM stops the plugin
cleanly.

What only a live cluster can show: that the kubelet sends these requests (its target path
layout, the access mode it derives from a PersistentVolume or an inline volume, its retries
and the periodic republish ``requiresRepublish`` asks for); the node-driver-registrar
handshake that registers the plugin with the kubelet; the propagation of the plugin's mounts
through the DaemonSet's ``Bidirectional`` kubelet volume to the host and into pod containers;
Pod Security admission of the example Job in a ``baseline`` namespace; the CSIDriver object's
effect (no attach, pod info on mount, both lifecycle modes). tests/unit/k8s/test_manifests.py checks
those manifests by rendering and validating them.
"""

from __future__ import annotations

import errno
import os
import random
import socket
import subprocess
import sys
import uuid
from types import SimpleNamespace

import grpc
import pytest

from cachefs import __version__
from cachefs.csi import DRIVER_NAME
from cachefs.csi.proto import csi_pb2
from cachefs.host import mounts, mounts_at
from tests.e2e.csi.plugin_process import (
    AccessMode,
    PluginProcess,
    capability,
    new_target,
    publish_request,
    unpublish_request,
)
from tests.waiting import WAIT_S
from tests.worker_process import REPO_ROOT, WorkerProcess, force_unmount

_rng = random.Random(21)
IMAGENET = {  # served from moto's S3, 1 MiB blocks: the big file spans several
    "train/n01440764/img_0.JPEG": _rng.randbytes(3 * 1024 * 1024 + 12345),
    "train/n01440764/img_1.JPEG": _rng.randbytes(180_000),
    "val/labels.txt": b"n01440764 tench\n",
}
COCO = {"annotations/instances.json": b'{"images": []}\n', "img/0001.jpg": _rng.randbytes(70_000)}


def _write_tree(root, files: dict[str, bytes]) -> None:
    for name, data in files.items():
        path = os.path.join(root, name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)


def _start_worker(base: str, moto_s3) -> WorkerProcess:
    """A worker serving ``imagenet`` (moto S3) and ``coco`` (a ``file://`` directory)."""
    bucket = moto_s3.make_bucket()
    for name, data in IMAGENET.items():
        moto_s3.put(bucket, f"imagenet/{name}", data)
    coco = os.path.join(base, "coco-source")
    _write_tree(coco, COCO)
    worker = WorkerProcess(os.path.join(base, "worker"), env=moto_s3.env).start()
    try:
        worker.add_dataset(
            "imagenet", f"s3://{bucket}/imagenet", endpoint=moto_s3.endpoint, block_size=1 << 20
        )
        worker.add_dataset("coco", f"file://{coco}")
    except BaseException:
        worker.cleanup()
        raise
    return worker


@pytest.fixture(scope="module")
def world(tmp_path_factory, moto_s3):
    base = str(tmp_path_factory.mktemp("csi"))
    worker = _start_worker(base, moto_s3)
    kubelet = os.path.join(base, "kubelet")
    os.makedirs(os.path.join(kubelet, "pods"))
    try:
        plugin = PluginProcess(
            os.path.join(base, "plugin"), state_dir=worker.state, kubelet_dir=kubelet
        ).start()
    except BaseException:
        worker.cleanup()
        raise
    yield SimpleNamespace(
        worker=worker, plugin=plugin, node=plugin.node, kubelet=kubelet, base=base
    )
    plugin.kill()
    _unmount_under(kubelet)
    worker.cleanup()


def _mounts_under(directory: str) -> list[str]:
    return [m.path for m in mounts() if m.path.startswith(os.path.realpath(directory) + "/")]


def _unmount_under(directory: str) -> None:
    for path in reversed(_mounts_under(directory)):
        force_unmount(path)


@pytest.fixture
def kubelet(world):
    """The kubelet directory; a test that fails leaves no mount in it for the next."""
    yield world.kubelet
    _unmount_under(world.kubelet)


def refused(call, request) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as caught:
        call(request, timeout=WAIT_S)
    return caught.value


def _raise(error: OSError) -> None:
    raise error


def read_tree(root: str) -> dict[str, bytes]:
    """Every file under ``root`` by relative path; an unreadable directory raises."""
    files = {}
    for directory, _, names in os.walk(root, onerror=_raise):
        for name in names:
            path = os.path.join(directory, name)
            with open(path, "rb") as f:
                files[os.path.relpath(path, root)] = f.read()
    return files


# --- identity ------------------------------------------------------------------------------------


def test_identity_and_node_information(world):
    info = world.plugin.identity.GetPluginInfo(csi_pb2.GetPluginInfoRequest(), timeout=WAIT_S)
    assert (info.name, info.vendor_version) == (DRIVER_NAME, __version__)
    plugin_caps = world.plugin.identity.GetPluginCapabilities(
        csi_pb2.GetPluginCapabilitiesRequest(), timeout=WAIT_S
    )
    assert list(plugin_caps.capabilities) == []  # no controller service: static provisioning
    probe = world.plugin.identity.Probe(csi_pb2.ProbeRequest(), timeout=WAIT_S)
    assert probe.HasField("ready") and probe.ready.value is True
    assert world.node.NodeGetInfo(csi_pb2.NodeGetInfoRequest(), timeout=WAIT_S).node_id == "node-1"
    node_caps = world.node.NodeGetCapabilities(csi_pb2.NodeGetCapabilitiesRequest(), timeout=WAIT_S)
    assert list(node_caps.capabilities) == []  # no stage step
    error = refused(world.node.NodeStageVolume, csi_pb2.NodeStageVolumeRequest(volume_id="x"))
    assert error.code() == grpc.StatusCode.UNIMPLEMENTED


# --- publish and unpublish -----------------------------------------------------------------------


def test_a_published_volume_is_the_dataset_read_only_and_byte_exact(world, kubelet):
    target = new_target(kubelet)
    world.node.NodePublishVolume(publish_request(target), timeout=WAIT_S)

    (mount,) = mounts_at(target)
    fuse = mounts_at(world.worker.mount)[-1]
    assert (mount.fstype, mount.device, mount.root) == ("fuse.cachefs", fuse.device, "/imagenet")
    assert {"ro", "nosuid", "nodev"} <= set(mount.options)
    # Only the dataset: no other dataset of the mount is reachable from the volume.
    assert sorted(os.listdir(target)) == ["train", "val"]
    assert read_tree(target) == IMAGENET
    for attempt in (
        lambda: os.open(os.path.join(target, "new-file"), os.O_WRONLY | os.O_CREAT),
        lambda: os.open(os.path.join(target, "val/labels.txt"), os.O_RDWR),
        lambda: os.mkdir(os.path.join(target, "new-dir")),
        lambda: os.chmod(os.path.join(target, "val/labels.txt"), 0o777),
    ):
        with pytest.raises(OSError) as caught:
            attempt()
        assert caught.value.errno == errno.EROFS

    world.node.NodeUnpublishVolume(unpublish_request(target), timeout=WAIT_S)
    assert not mounts_at(target)
    assert not os.path.lexists(target)  # the plugin created it, the plugin removes it
    assert os.path.isdir(os.path.dirname(target))  # the kubelet's parent directory stays


def test_publish_and_unpublish_are_idempotent(world, kubelet):
    target = new_target(kubelet)
    for _ in range(2):
        world.node.NodePublishVolume(publish_request(target), timeout=WAIT_S)
        assert len(mounts_at(target)) == 1
    assert read_tree(target) == IMAGENET
    for _ in range(2):
        world.node.NodeUnpublishVolume(unpublish_request(target), timeout=WAIT_S)
        assert not mounts_at(target) and not os.path.lexists(target)
    # A target that was never published (the kubelet cleaning up after a failed publish).
    never = new_target(kubelet)
    world.node.NodeUnpublishVolume(unpublish_request(never), timeout=WAIT_S)
    os.mkdir(never)  # created, then the publish failed before mounting
    world.node.NodeUnpublishVolume(unpublish_request(never), timeout=WAIT_S)
    assert not os.path.lexists(never)


def test_a_volume_handle_may_differ_from_the_dataset_it_names(world, kubelet):
    """Two PersistentVolumes of one dataset (one per namespace: a PV binds one claim) need two
    volumeHandles; the ``dataset`` attribute names the dataset."""
    target = new_target(kubelet)
    request = publish_request(target, "coco-team-a", context={"dataset": "coco"})
    world.node.NodePublishVolume(request, timeout=WAIT_S)
    assert read_tree(target) == COCO
    world.node.NodeUnpublishVolume(unpublish_request(target, "coco-team-a"), timeout=WAIT_S)


def test_an_inline_ephemeral_volume_names_its_dataset(world, kubelet):
    """An inline volume: the kubelet makes up the volume id, sends SINGLE_NODE_WRITER (it does
    for every inline volume) and ``readonly`` from the volume's ``readOnly``."""
    target = new_target(kubelet, "coco")
    inline = {"dataset": "coco", "csi.storage.k8s.io/ephemeral": "true"}
    volume_id = f"csi-{uuid.uuid4().hex}"
    writer = capability(AccessMode.SINGLE_NODE_WRITER)
    request = publish_request(target, volume_id, context=inline, capability_=writer)
    world.node.NodePublishVolume(request, timeout=WAIT_S)
    assert read_tree(target) == COCO
    world.node.NodeUnpublishVolume(unpublish_request(target, volume_id), timeout=WAIT_S)
    assert not os.path.lexists(target)


def test_another_volume_on_a_published_target_is_refused(world, kubelet):
    target = new_target(kubelet)
    world.node.NodePublishVolume(publish_request(target), timeout=WAIT_S)
    error = refused(world.node.NodePublishVolume, publish_request(target, "coco"))
    assert error.code() == grpc.StatusCode.ALREADY_EXISTS
    assert "not dataset coco" in error.details()
    assert read_tree(target) == IMAGENET  # the first volume is untouched
    world.node.NodeUnpublishVolume(unpublish_request(target), timeout=WAIT_S)


# --- refused requests ----------------------------------------------------------------------------


def _without_capability(target: str) -> csi_pb2.NodePublishVolumeRequest:
    request = publish_request(target)
    request.ClearField("volume_capability")
    return request


BAD_PUBLISHES = {
    # case: (request from the target path, status, words of the reason)
    "no volume id": (
        lambda t: publish_request(t, ""), grpc.StatusCode.INVALID_ARGUMENT, "volume_id is required"
    ),
    "no target path": (
        lambda t: publish_request(""), grpc.StatusCode.INVALID_ARGUMENT, "target_path is required"
    ),
    "no capability": (
        _without_capability, grpc.StatusCode.INVALID_ARGUMENT, "volume_capability is required"
    ),
    "no access mode": (
        lambda t: publish_request(t, capability_=capability(AccessMode.UNKNOWN)),
        grpc.StatusCode.INVALID_ARGUMENT, "access_mode is required",
    ),
    "relative target": (
        lambda t: publish_request(os.path.relpath(t)),
        grpc.StatusCode.INVALID_ARGUMENT, "is not an absolute path",
    ),
    "target outside the kubelet": (
        lambda t: publish_request(os.path.join(os.path.dirname(REPO_ROOT), "elsewhere", "mount")),
        grpc.StatusCode.INVALID_ARGUMENT, "outside the kubelet's pods directory",
    ),
    "target escaping with ..": (
        lambda t: publish_request(t.split("/pods/")[0] + "/pods/../escaped/mount"),
        grpc.StatusCode.INVALID_ARGUMENT, "outside the kubelet's pods directory",
    ),
    "unknown dataset": (
        lambda t: publish_request(t, "nosuch"),
        grpc.StatusCode.NOT_FOUND, "dataset 'nosuch' does not exist on the cachefs worker",
    ),
    "invalid dataset name": (
        lambda t: publish_request(t, "pv-1", context={"dataset": "../etc"}),
        grpc.StatusCode.INVALID_ARGUMENT, "invalid dataset name '../etc'",
    ),
    "misspelt attribute": (
        lambda t: publish_request(t, context={"datset": "coco"}),
        grpc.StatusCode.INVALID_ARGUMENT, "unknown volume attribute(s) datset",
    ),
    "inline volume without a dataset": (
        lambda t: publish_request(
            t, "csi-0123", context={"csi.storage.k8s.io/ephemeral": "true"},
            capability_=capability(AccessMode.SINGLE_NODE_WRITER),
        ),
        grpc.StatusCode.INVALID_ARGUMENT, "an inline cachefs volume names its dataset",
    ),
    "write access": (
        lambda t: publish_request(
            t, capability_=capability(AccessMode.SINGLE_NODE_WRITER), readonly=False
        ),
        grpc.StatusCode.FAILED_PRECONDITION, "cachefs volumes are read-only",
    ),
    "many writers": (
        lambda t: publish_request(
            t, capability_=capability(AccessMode.MULTI_NODE_MULTI_WRITER), readonly=False
        ),
        grpc.StatusCode.FAILED_PRECONDITION, "access mode MULTI_NODE_MULTI_WRITER writes",
    ),
    "block access": (
        lambda t: publish_request(t, capability_=capability(block=True)),
        grpc.StatusCode.FAILED_PRECONDITION, "block access is not supported",
    ),
    "mount options": (
        lambda t: publish_request(t, capability_=capability(flags=("rw", "noatime"))),
        grpc.StatusCode.FAILED_PRECONDITION, "take no mount options (got rw, noatime)",
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", BAD_PUBLISHES)
def test_a_bad_publish_is_refused_with_its_code_and_changes_nothing(world, kubelet, case):
    make, code, reason = BAD_PUBLISHES[case]
    target = new_target(kubelet)
    error = refused(world.node.NodePublishVolume, make(target))
    assert error.code() == code, error.details()
    assert reason in error.details()
    assert "\n" not in error.details()
    assert not _mounts_under(kubelet)
    assert not os.path.lexists(target)
    assert not os.path.lexists(os.path.join(kubelet, "escaped"))


BAD_UNPUBLISHES = {
    "no volume id": (lambda t: unpublish_request(t, ""), "volume_id is required"),
    "no target path": (lambda t: unpublish_request(""), "target_path is required"),
    "relative target": (lambda t: unpublish_request(os.path.relpath(t)), "not an absolute path"),
    "target outside the kubelet": (lambda t: unpublish_request("/mnt"), "outside the kubelet's"),
}


@pytest.mark.parametrize("case", BAD_UNPUBLISHES)
def test_a_bad_unpublish_is_refused_and_unmounts_nothing(world, kubelet, case):
    make, reason = BAD_UNPUBLISHES[case]
    target = new_target(kubelet)
    world.node.NodePublishVolume(publish_request(target), timeout=WAIT_S)
    error = refused(world.node.NodeUnpublishVolume, make(target))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert reason in error.details()
    assert len(mounts_at(target)) == 1 and read_tree(target) == IMAGENET
    world.node.NodeUnpublishVolume(unpublish_request(target), timeout=WAIT_S)


def test_a_symlink_never_leads_a_mount_outside_the_pods_directory(world, kubelet, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    # The target itself a symlink: mount(2) would follow it.
    target = new_target(kubelet)
    os.symlink(outside, target)
    error = refused(world.node.NodePublishVolume, publish_request(target))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "exists and is not a directory" in error.details()
    # A parent that is a symlink out of the pods directory.
    pod = os.path.join(kubelet, "pods", "linked-pod")
    os.symlink(outside, pod)
    error = refused(world.node.NodePublishVolume, publish_request(os.path.join(pod, "mount")))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "outside the kubelet's pods directory" in error.details()
    assert not mounts_at(str(outside)) and not mounts_at(str(outside / "mount"))
    assert os.listdir(outside) == []
    os.unlink(pod)


# --- the worker down, restarted -------------------------------------------------------------------


def test_without_a_worker_publish_is_unavailable_and_unpublish_still_works(world, tmp_path):
    """The kubelet retries UNAVAILABLE; unpublish needs no worker (a pod ending while the
    worker is down must not keep its volume)."""
    kubelet = str(tmp_path / "kubelet")
    plugin = PluginProcess(
        str(tmp_path / "plugin"), state_dir=str(tmp_path / "no-worker"), kubelet_dir=kubelet
    ).start()
    try:
        target = new_target(kubelet)
        error = refused(plugin.node.NodePublishVolume, publish_request(target))
        assert error.code() == grpc.StatusCode.UNAVAILABLE
        assert "no cachefs worker is running" in error.details()
        assert not os.path.lexists(target)
        os.mkdir(target)
        plugin.node.NodeUnpublishVolume(unpublish_request(target), timeout=WAIT_S)
        assert not os.path.lexists(target)
        assert plugin.terminate() == 0
        assert not os.path.lexists(plugin.socket)  # removed on the way out
    finally:
        plugin.kill()


def test_after_a_worker_restart_a_republish_revives_the_volume_in_the_pods_view(tmp_path, moto_s3):
    """The kubelet directory is a shared mount (the DaemonSet's ``Bidirectional`` volume); the
    pod's view is a slave bind of the target (a volumeMount with ``HostToContainer``). A
    killed worker leaves the volume dead (ENOTCONN, no wrong bytes); once a worker serves
    again, the republish (``requiresRepublish``) mounts the live dataset on the target, and the
    pod's view receives it."""
    base = str(tmp_path)
    worker = _start_worker(base, moto_s3)
    kubelet = os.path.join(base, "kubelet")
    pod_view = os.path.join(base, "container-rootfs", "data")
    os.makedirs(os.path.join(kubelet, "pods"))
    os.makedirs(pod_view)
    subprocess.run(["mount", "--bind", kubelet, kubelet], check=True)
    plugin = None
    try:
        subprocess.run(["mount", "--make-shared", kubelet], check=True)
        plugin = PluginProcess(
            os.path.join(base, "plugin"), state_dir=worker.state, kubelet_dir=kubelet
        ).start()
        target = new_target(kubelet)
        plugin.node.NodePublishVolume(publish_request(target), timeout=WAIT_S)
        subprocess.run(["mount", "--bind", target, pod_view], check=True)
        subprocess.run(["mount", "--make-slave", pod_view], check=True)
        assert read_tree(pod_view) == IMAGENET

        worker.crash()  # SIGKILL: the FUSE connection dies with it
        for view in (target, pod_view):
            with pytest.raises(OSError) as caught:
                read_tree(view)
            assert caught.value.errno == errno.ENOTCONN
        error = refused(plugin.node.NodePublishVolume, publish_request(target))
        assert error.code() == grpc.StatusCode.UNAVAILABLE

        worker.start()  # the same state directory: the datasets come back
        plugin.node.NodePublishVolume(publish_request(target), timeout=WAIT_S)
        assert read_tree(target) == IMAGENET
        assert read_tree(pod_view) == IMAGENET
        plugin.node.NodePublishVolume(publish_request(target), timeout=WAIT_S)  # idempotent
        assert len(mounts_at(target)) == 2  # the live bind on the dead one

        plugin.node.NodeUnpublishVolume(unpublish_request(target), timeout=WAIT_S)
        assert not mounts_at(target) and not os.path.lexists(target)
    finally:
        if plugin is not None:
            plugin.kill()
        _unmount_under(base)
        force_unmount(kubelet)
        worker.cleanup()


def test_a_call_on_a_target_in_progress_is_aborted_and_a_worker_hanging_up_is_unavailable(
    tmp_path,
):
    """A "worker" that accepts the plugin's connection and then hangs up. While the first
    publish waits for it, a second call on the same target path (a retry) is ABORTED, the
    spec's "operation pending for volume"; the first then ends UNAVAILABLE."""
    state = tmp_path / "state"
    state.mkdir()
    kubelet = str(tmp_path / "kubelet")
    with socket.socket(socket.AF_UNIX) as fake_worker:
        fake_worker.bind(str(state / "worker.sock"))
        fake_worker.listen(4)
        fake_worker.settimeout(WAIT_S)
        plugin = PluginProcess(str(tmp_path / "plugin"), state_dir=str(state), kubelet_dir=kubelet)
        plugin.start()
        try:
            target = new_target(kubelet)
            first = plugin.node.NodePublishVolume.future(publish_request(target), timeout=WAIT_S)
            connection, _ = fake_worker.accept()  # the first call is inside, asking the worker
            with connection:
                for call, request in (
                    (plugin.node.NodePublishVolume, publish_request(target)),
                    (plugin.node.NodeUnpublishVolume, unpublish_request(target)),
                ):
                    error = refused(call, request)
                    assert error.code() == grpc.StatusCode.ABORTED
                    assert f"an operation on {target} is already in progress" in error.details()
            with pytest.raises(grpc.RpcError) as caught:
                first.result()
            assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "lost the connection to the cachefs worker" in caught.value.details()
            assert not os.path.lexists(target)
        finally:
            plugin.kill()


# --- the plugin process ---------------------------------------------------------------------------


def test_a_socket_left_by_a_killed_plugin_is_replaced_and_a_live_one_is_refused(world, tmp_path):
    kubelet = str(tmp_path / "kubelet")
    first = PluginProcess(str(tmp_path), state_dir=world.worker.state, kubelet_dir=kubelet)
    with socket.socket(socket.AF_UNIX) as left:  # bound, then closed: nobody listens
        left.bind(first.socket)
    first.start()
    try:
        second = PluginProcess(str(tmp_path), state_dir=world.worker.state, kubelet_dir=kubelet)
        done = subprocess.run(second.command, capture_output=True, text=True, timeout=WAIT_S)
        assert done.returncode == 1
        assert done.stderr.strip().splitlines() == [
            f"cachefs: error: --endpoint {first.socket} is served by another process "
            "(a plugin running?)"
        ]
        info = first.identity.GetPluginInfo(csi_pb2.GetPluginInfoRequest(), timeout=WAIT_S)
        assert info.name == DRIVER_NAME  # the first still serves
        assert first.terminate() == 0
    finally:
        first.kill()


def test_an_endpoint_that_is_not_a_unix_socket_is_one_line(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "cachefs", "csi", "--endpoint", "tcp://127.0.0.1:10000",
         "--node", "n"],
        capture_output=True, text=True, timeout=WAIT_S, cwd=REPO_ROOT,
    )  # fmt: skip
    assert done.returncode == 1
    assert done.stderr.strip() == (
        "cachefs: error: --endpoint tcp://127.0.0.1:10000: use unix:///ABSOLUTE/PATH "
        "(a unix socket)"
    )
