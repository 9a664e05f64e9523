"""``python -m modelstage.operator``: the operator, as ``kopf run`` would start it.

Options mirror ``kopf run``'s (``--namespace``/``-n`` repeatable, ``--all-namespaces``,
``--standalone``, ``--priority``, ``--liveness``); the rest comes from ``MODELSTAGE_OPERATOR_*``
variables (``settings.OperatorConfig``). Logs are JSON lines by default (``--log-format``).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import kopf


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m modelstage.operator", description=__doc__)
    scope = parser.add_mutually_exclusive_group(required=True)
    scope.add_argument("-n", "--namespace", action="append", dest="namespaces", default=[])
    scope.add_argument("-A", "--all-namespaces", action="store_true")
    parser.add_argument("--standalone", action="store_true", help="no peering (one instance)")
    parser.add_argument("--priority", type=int, default=None, help="peering priority")
    parser.add_argument("--liveness", default=None, help="e.g. http://0.0.0.0:8081/healthz")
    parser.add_argument(
        "--log-format", choices=[f.name.lower() for f in kopf.LogFormat], default="json"
    )
    parser.add_argument("--verbose", action="store_true")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    kopf.configure(verbose=args.verbose, log_format=kopf.LogFormat[args.log_format.upper()])
    from . import handlers  # noqa: F401  (registers the handlers)

    settings = kopf.OperatorSettings()
    # Serving named namespaces needs no cluster-scoped reads: kopf then neither lists
    # namespaces nor watches CRDs, which a namespaced Role does not grant (without this it
    # retries the refused requests with backoff for a minute and more before it serves).
    settings.scanning.disabled = not args.all_namespaces
    kopf.run(
        settings=settings,
        standalone=args.standalone,
        priority=args.priority,
        liveness_endpoint=args.liveness,
        clusterwide=args.all_namespaces,
        namespaces=args.namespaces,
        memo=kopf.Memo(watched_namespaces=None if args.all_namespaces else tuple(args.namespaces)),
    )


if __name__ == "__main__":
    main()
