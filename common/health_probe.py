"""`python -m common.health_probe`: exit 0 when a pdserve server says SERVING.

For exec probes (Kubernetes) on TLS and mTLS ports, which the built-in gRPC
probe cannot check: it reads the component's own PDSERVE_TLS_* variables, so
in a pod that already has them set, ``python -m common.health_probe --address
localhost:50061`` is the whole probe. It imports only grpc, not the engine.

Exit codes: 0 serving, 1 not serving or unreachable, 2 bad usage.
"""

from __future__ import annotations

import argparse
import sys

from common.grpc_server import OVERALL, health_check
from common.tls import TLSConfig, add_tls_arguments


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m common.health_probe", description=__doc__.split("\n")[0]
    )
    p.add_argument("--address", required=True, help="HOST:PORT")
    p.add_argument("--service", default=OVERALL, help="service name (default: the whole server)")
    p.add_argument("--timeout", type=float, default=2.0, help="seconds")
    add_tls_arguments(p)
    try:
        args = p.parse_args(argv)
        tls = TLSConfig.from_args(args)
    except SystemExit as e:
        return 2 if e.code else 0
    except ValueError as e:
        print(f"health_probe: error: {e}", file=sys.stderr)
        return 2
    if health_check(args.address, args.service, timeout=args.timeout, tls=tls):
        return 0
    print(f"health_probe: {args.address} is not serving", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
