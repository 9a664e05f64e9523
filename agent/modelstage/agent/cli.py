"""``modelstage agent``: the node cache's DaemonSet. The stager's CLI offers it as one of its
commands; the agent image (no torch, no stager) runs it as ``python -m modelstage.agent agent``
with the same arguments, through ``main`` here.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from modelstage.core.errors import ModelstageError
from modelstage.core.quantity import parse_bytes


def run_agent_command(args: argparse.Namespace) -> int:
    """Run the agent with the parsed arguments (until it is stopped)."""
    from .agent import AgentSettings, run_agent

    budget = parse_bytes(args.budget, "--budget")
    quota = _bytes_or_zero(args.namespace_quota, "--namespace-quota")
    rate = _bytes_or_zero(args.verify_rate, "--verify-rate")
    settings = AgentSettings(
        args.node, Path(args.root), budget, args.interval, args.metrics_port,
        args.metrics_address, args.kubeconfig, args.copy_address, args.copy_port, quota, rate,
        args.allow_tokens_without_node,
    )  # fmt: skip
    return run_agent(settings)


def _bytes_or_zero(text: str, flag: str) -> int:
    """``parse_bytes``, or 0 (off)."""
    return 0 if text.strip() == "0" else parse_bytes(text, flag)


def add_agent_parser(sub: Any) -> None:
    """The ``agent`` subcommand and its options, on ``sub`` (argparse's subparsers)."""
    ag = sub.add_parser(
        "agent", help="the node cache agent: receive copies, report, warm, evict, re-verify"
    )
    ag.add_argument("--node", required=True, help="this node's name")
    ag.add_argument("--root", required=True, help="the node-local cache root")
    ag.add_argument("--budget", required=True, help="bytes the root may hold (e.g. 500Gi)")
    ag.add_argument("--interval", type=float, default=10.0, metavar="SECONDS")
    ag.add_argument("--metrics-port", type=int, default=0, help="Prometheus metrics (0: none)")
    ag.add_argument("--metrics-address", default="127.0.0.1", help="the metrics bind address")
    ag.add_argument("--kubeconfig", help="default: in-cluster credentials, else KUBECONFIG")
    ag.add_argument("--copy-address", default="127.0.0.1",
                    help="where copy Jobs reach the agent (the pod IP in the chart)")  # fmt: skip
    ag.add_argument("--copy-port", type=int, default=9103, help="0: any free port")
    ag.add_argument(
        "--namespace-quota",
        default="0",
        help="bytes of copies one namespace may hold on this node (0: no quota)",
    )
    ag.add_argument("--verify-rate", default="50M",
                    help="bytes per second re-verification reads (0: off)")  # fmt: skip
    ag.add_argument(
        "--allow-tokens-without-node",
        action="store_true",
        help="accept copy Jobs' tokens without the node-name claim (Kubernetes below 1.30)",
    )
    ag.set_defaults(run=run_agent_command)


def main(argv: Sequence[str] | None = None) -> int:
    """The agent image's entry point: ``agent ...`` as ``modelstage agent ...`` reads it."""
    parser = argparse.ArgumentParser(prog="python -m modelstage.agent")
    add_agent_parser(parser.add_subparsers(required=True, metavar="COMMAND"))
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        code: int = args.run(args)
    except ModelstageError as e:
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    return code
