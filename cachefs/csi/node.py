"""The CSI Identity and Node services of the cachefs node plugin.

NodePublishVolume bind-mounts ``<worker mount>/<dataset>`` read-only (``ro,nosuid,nodev``) on
the pod's target path; NodeUnpublishVolume unmounts it and removes the target directory. The
dataset is the volume attribute ``dataset``, else (a PersistentVolume) the ``volumeHandle``.
Before each publish the node's worker is asked, over its control socket, whether it serves
the dataset and where its FUSE mount is.

Choices where the spec leaves room (the CSI spec v1.12.0, cachefs/csi/proto/README.md):

- Read-only volumes only. A publish that could write (a writer access mode without
  ``readonly``) is FAILED_PRECONDITION, the spec's code for "the CO has specified capabilities
  not supported by the volume". A writer access mode *with* ``readonly`` is accepted: it is what
  the kubelet sends for an inline volume with ``readOnly: true`` (inline volumes are always
  SINGLE_NODE_WRITER there). Block access and mount options are refused the same way.
- A request that is malformed (no volume id, target path or capability; a relative target; one
  outside the kubelet's pods directory; an unknown volume attribute; an inline volume naming
  no dataset) is INVALID_ARGUMENT.
- A dataset the worker does not serve is NOT_FOUND; a worker that does not answer, has not
  mounted yet, or failed to load the dataset is UNAVAILABLE. The kubelet retries both.
- A second call on a target path while one runs is ABORTED ("operation pending for volume").
- Recovery after a worker restart. The bind mounts of a FUSE mount die with the worker that
  served it (reads fail with ENOTCONN, never return wrong bytes), and a new worker's mount
  does not replace them. The CSIDriver asks for ``requiresRepublish``, so the kubelet calls
  NodePublishVolume again periodically; a target whose mount is the dataset of a former
  FUSE mount gets a bind of the live one on top of it. A pod whose volumeMount says
  ``mountPropagation: HostToContainer`` sees that new mount (its view of the volume is a
  slave of the target's); other pods keep the dead one until they restart. Unpublish removes
  every mount stacked on the target.
- Probe is always ready: the plugin itself serves. Whether the worker is up is answered per
  publish; a probe failing while the worker restarts would have the plugin restarted for
  nothing (the CSI livenessprobe sidecar restarts a plugin that is not ready).
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import stat
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

import grpc
from google.protobuf.wrappers_pb2 import BoolValue

from cachefs import __version__
from cachefs.client import ControlClient, ControlError, WorkerNotRunning, one_line
from cachefs.csi import DATASET_ATTRIBUTE, DRIVER_NAME, WORKER_TIMEOUT_S
from cachefs.csi.mounts import (
    READ_ONLY_OPTIONS,
    MountFailed,
    bind_read_only,
    unmount_all,
    visible_mount,
)
from cachefs.csi.proto import csi_pb2, csi_pb2_grpc
from cachefs.errors import ConfigError
from cachefs.host import MountEntry, resolve_mountpoint, resolve_without_entering
from cachefs.protocol import check_dataset_name

log = logging.getLogger(__name__)

#: The type /proc/self/mountinfo shows for the worker's FUSE mount (its ``subtype=cachefs``
#: mount option, cachefs/fs/fuse_ops.py).
FUSE_TYPE = "fuse.cachefs"
#: Volume context keys the kubelet adds: the pod's name, namespace, uid and service account
#: (the CSIDriver's ``podInfoOnMount``), and ``ephemeral`` for an inline volume.
KUBELET_KEY_PREFIX = "csi.storage.k8s.io/"
EPHEMERAL_KEY = KUBELET_KEY_PREFIX + "ephemeral"

_Mode = csi_pb2.VolumeCapability.AccessMode.Mode
READ_ONLY_MODES = frozenset({_Mode.SINGLE_NODE_READER_ONLY, _Mode.MULTI_NODE_READER_ONLY})


class VolumeError(Exception):
    """A request refused with a gRPC status ``code``; ``str()`` is the one-line reason."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code


def _invalid(message: str) -> VolumeError:
    return VolumeError(grpc.StatusCode.INVALID_ARGUMENT, message)


def _status_of(exc: Exception) -> tuple[grpc.StatusCode, str]:
    """The one mapping of a failure to the gRPC status the CO gets."""
    if isinstance(exc, VolumeError):
        return exc.code, str(exc)
    if isinstance(exc, WorkerNotRunning):
        return grpc.StatusCode.UNAVAILABLE, str(exc)
    if isinstance(exc, ControlError):
        return grpc.StatusCode.UNAVAILABLE, f"the cachefs worker refused: {exc}"
    if isinstance(exc, MountFailed):
        if exc.errno == errno.EPERM:
            return grpc.StatusCode.INTERNAL, (
                f"{exc}: the plugin needs CAP_SYS_ADMIN (a privileged container) to mount"
            )
        return grpc.StatusCode.INTERNAL, str(exc)
    log.error("unexpected failure", exc_info=exc)
    return grpc.StatusCode.INTERNAL, f"unexpected error: {type(exc).__name__}: {exc}"


_Service = TypeVar("_Service")
_Request = TypeVar("_Request")
_Response = TypeVar("_Response")


def _answered(
    method: Callable[[_Service, _Request, grpc.ServicerContext], _Response],
) -> Callable[[_Service, _Request, grpc.ServicerContext], _Response]:
    """Run an RPC; any failure becomes an aborted call with its status and one-line reason."""

    @functools.wraps(method)
    def call(self: _Service, request: _Request, context: grpc.ServicerContext) -> _Response:
        try:
            return method(self, request, context)
        except Exception as exc:
            code, message = _status_of(exc)
        message = one_line(message)
        log.warning("%s refused (%s): %s", method.__name__, code.name, message)
        context.abort(code, message)
        raise AssertionError("grpc's ServicerContext.abort always raises")

    return call


class IdentityService(csi_pb2_grpc.IdentityServicer):
    @_answered
    def GetPluginInfo(
        self, request: csi_pb2.GetPluginInfoRequest, context: grpc.ServicerContext
    ) -> csi_pb2.GetPluginInfoResponse:
        return csi_pb2.GetPluginInfoResponse(name=DRIVER_NAME, vendor_version=__version__)

    @_answered
    def GetPluginCapabilities(
        self, request: csi_pb2.GetPluginCapabilitiesRequest, context: grpc.ServicerContext
    ) -> csi_pb2.GetPluginCapabilitiesResponse:
        # No CONTROLLER_SERVICE: volumes are provisioned statically and need no attach.
        return csi_pb2.GetPluginCapabilitiesResponse(capabilities=[])

    @_answered
    def Probe(
        self, request: csi_pb2.ProbeRequest, context: grpc.ServicerContext
    ) -> csi_pb2.ProbeResponse:
        return csi_pb2.ProbeResponse(ready=BoolValue(value=True))  # why always: module doc


class NodeService(csi_pb2_grpc.NodeServicer):
    """NodePublishVolume, NodeUnpublishVolume, NodeGetCapabilities, NodeGetInfo; the other
    Node calls answer UNIMPLEMENTED (the generated base class)."""

    def __init__(self, *, node: str, state_dir: str, kubelet_dir: str):
        self.node = node
        self.state_dir = state_dir
        # Resolved once: target paths are compared with their parents' symlinks resolved.
        self.pods_dir = os.path.join(os.path.realpath(kubelet_dir), "pods")
        self._lock = threading.Lock()
        self._busy: set[str] = set()  # target paths with a call in progress

    @_answered
    def NodeGetInfo(
        self, request: csi_pb2.NodeGetInfoRequest, context: grpc.ServicerContext
    ) -> csi_pb2.NodeGetInfoResponse:
        return csi_pb2.NodeGetInfoResponse(node_id=self.node)

    @_answered
    def NodeGetCapabilities(
        self, request: csi_pb2.NodeGetCapabilitiesRequest, context: grpc.ServicerContext
    ) -> csi_pb2.NodeGetCapabilitiesResponse:
        # None: no stage step (a bind mount needs none), no volume stats, no expansion.
        return csi_pb2.NodeGetCapabilitiesResponse(capabilities=[])

    @_answered
    def NodePublishVolume(
        self, request: csi_pb2.NodePublishVolumeRequest, context: grpc.ServicerContext
    ) -> csi_pb2.NodePublishVolumeResponse:
        _required(request.volume_id, "volume_id")
        target = self._target_path(request.target_path)
        _check_capability(request)
        dataset = _dataset_of(request)
        with self._exclusive(target):
            source, fuse = self._source(dataset)
            current = visible_mount(target)
            if current is not None and _is_bind_of(current, fuse, dataset):
                return csi_pb2.NodePublishVolumeResponse()  # published already: idempotent
            if current is not None and not _is_stale_bind_of(current, dataset):
                raise VolumeError(
                    grpc.StatusCode.ALREADY_EXISTS,
                    f"{target} already has another volume mounted "
                    f"({current.fstype} {current.root}), not dataset {dataset}",
                )
            if current is None:
                _make_target_dir(target)
            else:
                # The dataset from a FUSE mount that is gone (the worker restarted): readers
                # get ENOTCONN. The live one goes on top rather than in its place: a pod
                # whose volumeMount has HostToContainer propagation receives a mount made on
                # its volume, not the removal of the volume itself (see the module doc).
                log.info("%s: dataset %s of a former worker mount: republished", target, dataset)
            bind_read_only(source, target)
        log.info(
            "published dataset %s (volume %s) at %s for pod %s/%s",
            dataset,
            request.volume_id,
            target,
            request.volume_context.get(KUBELET_KEY_PREFIX + "pod.namespace", "?"),
            request.volume_context.get(KUBELET_KEY_PREFIX + "pod.name", "?"),
        )
        return csi_pb2.NodePublishVolumeResponse()

    @_answered
    def NodeUnpublishVolume(
        self, request: csi_pb2.NodeUnpublishVolumeRequest, context: grpc.ServicerContext
    ) -> csi_pb2.NodeUnpublishVolumeResponse:
        _required(request.volume_id, "volume_id")
        target = self._target_path(request.target_path)
        with self._exclusive(target):
            removed = unmount_all(target)
            try:
                os.rmdir(target)
            except FileNotFoundError:
                pass  # never published, or unpublished already: done (idempotent)
            except OSError as exc:
                raise VolumeError(
                    grpc.StatusCode.INTERNAL,
                    f"cannot remove the target directory {target}: {exc.strerror}",
                ) from None
        log.info(
            "unpublished volume %s from %s (%d mounts removed)", request.volume_id, target, removed
        )
        return csi_pb2.NodeUnpublishVolumeResponse()

    # --- helpers ----------------------------------------------------------------------------

    def _target_path(self, path: str) -> str:
        """The target path, checked and resolved (``..`` and the parents' symlinks)."""
        _required(path, "target_path")
        if not os.path.isabs(path):
            raise _invalid(f"target_path {path!r} is not an absolute path")
        resolved = resolve_without_entering(path)
        if not resolved.startswith(self.pods_dir + os.sep):
            raise _invalid(
                f"target_path {path} is outside the kubelet's pods directory {self.pods_dir} "
                "(--kubelet-dir)"
            )
        return resolved

    @contextmanager
    def _exclusive(self, target: str) -> Iterator[None]:
        with self._lock:
            if target in self._busy:
                raise VolumeError(
                    grpc.StatusCode.ABORTED, f"an operation on {target} is already in progress"
                )
            self._busy.add(target)
        try:
            yield
        finally:
            with self._lock:
                self._busy.discard(target)

    def _source(self, dataset: str) -> tuple[str, MountEntry]:
        """The directory of ``dataset`` in the worker's live FUSE mount, and that mount."""
        with ControlClient(self.state_dir, timeout=WORKER_TIMEOUT_S) as worker:
            status = worker.status()
        mount = status["mount"]
        if not status.get("mounted"):
            raise VolumeError(
                grpc.StatusCode.UNAVAILABLE,
                f"the cachefs worker of {self.state_dir} has not mounted {mount} yet",
            )
        served = {entry["name"]: entry for entry in status.get("datasets", [])}
        if dataset not in served:
            names = ", ".join(sorted(served)) or "none"
            raise VolumeError(
                grpc.StatusCode.NOT_FOUND,
                f"dataset {dataset!r} does not exist on the cachefs worker of node {self.node} "
                f"(it serves: {names}); add it with `cachefs dataset add {dataset} URI`",
            )
        if served[dataset].get("state") != "ready":
            raise VolumeError(
                grpc.StatusCode.UNAVAILABLE,
                f"dataset {dataset} is not ready on the cachefs worker of node {self.node}: "
                f"{served[dataset].get('error') or served[dataset].get('state')}",
            )
        fuse = visible_mount(resolve_mountpoint(mount))  # a worker's --mount may be a symlink
        if fuse is None or fuse.fstype != FUSE_TYPE:
            raise VolumeError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"the worker's mount {mount} is not visible to this plugin: give the plugin "
                "the host directory holding it with mountPropagation HostToContainer",
            )
        return os.path.join(fuse.path, dataset), fuse


def _required(value: str, name: str) -> None:
    if not value:
        raise _invalid(f"{name} is required")


def _check_capability(request: csi_pb2.NodePublishVolumeRequest) -> None:
    if not request.HasField("volume_capability"):
        raise _invalid("volume_capability is required")
    capability = request.volume_capability
    if capability.HasField("block"):
        raise VolumeError(
            grpc.StatusCode.FAILED_PRECONDITION,
            "cachefs volumes are directories: block access is not supported",
        )
    if not capability.HasField("mount"):
        raise _invalid("volume_capability needs the mount access type")
    if capability.mount.mount_flags:
        raise VolumeError(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"cachefs volumes take no mount options (got {', '.join(capability.mount.mount_flags)})"
            f": they are always {','.join(READ_ONLY_OPTIONS)}",
        )
    mode = capability.access_mode.mode
    if mode == _Mode.UNKNOWN:
        raise _invalid("volume_capability.access_mode is required")
    if mode not in READ_ONLY_MODES and not request.readonly:
        raise VolumeError(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"cachefs volumes are read-only: access mode {_Mode.Name(mode)} writes; use "
            "accessModes [ReadOnlyMany] on the PersistentVolume and its claim, or readOnly: "
            "true on an inline volume",
        )


def _dataset_of(request: csi_pb2.NodePublishVolumeRequest) -> str:
    """The dataset the volume names: its ``dataset`` attribute, else its volume id (a
    PersistentVolume's ``volumeHandle``; an inline volume's id is made up by the kubelet)."""
    attributes = request.volume_context
    unknown = sorted(
        key
        for key in attributes
        if key != DATASET_ATTRIBUTE and not key.startswith(KUBELET_KEY_PREFIX)
    )
    if unknown:
        raise _invalid(
            f"unknown volume attribute(s) {', '.join(unknown)}: a cachefs volume takes only "
            f"{DATASET_ATTRIBUTE!r}"
        )
    dataset = attributes.get(DATASET_ATTRIBUTE)
    if dataset is None:
        if attributes.get(EPHEMERAL_KEY) == "true":
            raise _invalid(
                "an inline cachefs volume names its dataset: volumeAttributes: "
                f"{{{DATASET_ATTRIBUTE}: NAME}}"
            )
        dataset = request.volume_id
    try:
        return check_dataset_name(dataset)
    except ConfigError as exc:
        raise _invalid(str(exc)) from None


def _is_bind_of(entry: MountEntry, fuse: MountEntry, dataset: str) -> bool:
    """``entry`` is a read-only bind of ``dataset`` from the live FUSE mount ``fuse``."""
    return (
        entry.device == fuse.device
        and entry.root == "/" + dataset
        and set(READ_ONLY_OPTIONS) <= set(entry.options)
    )


def _is_stale_bind_of(entry: MountEntry, dataset: str) -> bool:
    """``entry`` binds ``dataset`` from a cachefs FUSE mount other than the live one."""
    return entry.fstype == FUSE_TYPE and entry.root == "/" + dataset


def _make_target_dir(target: str) -> None:
    """Create the target directory (the SP's job, spec: ``target_path``); an existing
    directory is fine, anything else at that path is refused (a symlink would be followed by
    mount(2))."""
    try:
        os.mkdir(target, 0o750)
        return
    except FileExistsError:
        pass
    except FileNotFoundError:
        raise _invalid(f"the parent directory of target_path {target} does not exist") from None
    if not stat.S_ISDIR(os.lstat(target).st_mode):
        raise _invalid(f"target_path {target} exists and is not a directory")
