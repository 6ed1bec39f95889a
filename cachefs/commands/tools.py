"""Tools beside the worker: `cachefs demo` (a generated dataset, served and verified) and
`cachefs csi` (the Kubernetes CSI node plugin)."""

from __future__ import annotations

import argparse

from cachefs.csi import DEFAULT_KUBELET_DIR


def cmd_demo(args: argparse.Namespace) -> int:
    from cachefs.demo import run_demo

    return run_demo(
        workdir=args.workdir, files=args.files, keep=args.keep, log_level=args.log_level
    )


def cmd_csi(args: argparse.Namespace) -> int:
    from cachefs.csi import DRIVER_NAME
    from cachefs.csi.server import PluginConfig, run_until_signalled

    config = PluginConfig(
        endpoint=args.endpoint, node=args.node, state_dir=args.state, kubelet_dir=args.kubelet_dir
    )
    run_until_signalled(
        config,
        f"cachefs: CSI node plugin {DRIVER_NAME} for node {config.node} on {config.endpoint} "
        f"(worker state {config.state_dir}, targets under {config.kubelet_dir}/pods)",
    )
    return 0


def add_tool_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """`cachefs demo`, `csi`."""
    demo = sub.add_parser("demo", help="generate a dataset, serve it, read it, verify every byte")
    demo.add_argument("--workdir", default="/tmp/cachefs-demo")
    demo.add_argument("--files", type=int, default=2000)
    demo.add_argument("--keep", action="store_true", help="leave the worker running")
    demo.set_defaults(func=cmd_demo)

    csi = sub.add_parser(
        "csi", help="run the Kubernetes CSI node plugin: datasets as read-only volumes"
    )
    csi.add_argument("--endpoint", required=True, help="unix:///PATH of the plugin's socket")
    csi.add_argument("--node", required=True, help="this node's id (the Kubernetes node name)")
    csi.add_argument(
        "--kubelet-dir",
        default=DEFAULT_KUBELET_DIR,
        help="the kubelet's root directory: target paths outside its pods/ are refused "
        "(default %(default)s)",
    )
    csi.set_defaults(func=cmd_csi)
