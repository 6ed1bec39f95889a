"""The CSI node plugin: cachefs datasets as Kubernetes volumes (``cachefs csi``).

A pod's volume (a PersistentVolume per dataset, or an inline ephemeral volume naming one) is
a read-only bind mount of ``<worker mount>/<dataset>`` on the pod's target path, made by this
plugin on the node where the pod runs. The plugin serves the CSI v1 Identity and Node services
(cachefs/csi/proto/csi.proto, vendored) over a unix socket to the kubelet; it asks the node's
cachefs worker, over the worker's control socket, which datasets it serves and where its FUSE
mount is. It has no controller service: volumes are provisioned statically (an operator
writes the PersistentVolume) and need no attach step.

    node.py     the Identity and Node services: request checks, publish, unpublish, and the
                one mapping of failures to gRPC status codes
    mounts.py   the mount(2) calls: a read-only bind mount and its removal
    server.py   the gRPC server on the unix socket, stopped cleanly on SIGTERM
    proto/      csi.proto of the CSI spec and its generated Python modules
"""

from __future__ import annotations

#: The driver name: the CSIDriver object's name, the PersistentVolumes' ``csi.driver``.
DRIVER_NAME = "csi.cachefs.io"
#: The kubelet's root directory; target paths must lie in its ``pods/`` directory.
DEFAULT_KUBELET_DIR = "/var/lib/kubelet"
#: How long a publish waits for the worker's answer. The kubelet gives a NodePublishVolume
#: two minutes, and retries; a worker that is up answers in milliseconds.
WORKER_TIMEOUT_S = 15.0
#: The volume attribute (``volumeAttributes`` of a PersistentVolume or of an inline volume)
#: that names the dataset. A PersistentVolume without it serves the dataset named by its
#: ``volumeHandle``.
DATASET_ATTRIBUTE = "dataset"
