"""``halfmoon certs --out DIR``: a development CA and one certificate per service for cluster mTLS.

    halfmoon certs --out ./certs                                  # registry router prefill decode client
    halfmoon certs --out ./certs --services prefill-0 decode-0 --hosts 10.0.0.5 node-a
    halfmoon up --tls --tls-dir ./certs

An existing ``ca.pem`` / ``ca-key.pem`` in DIR is reused, so services can be added later. Keys are
written 0600. Development only: in production use certificates from your own PKI.
"""

from __future__ import annotations

import argparse
import sys


def add_arguments(p: argparse.ArgumentParser) -> None:
    from security.certs import DEFAULT_SERVICES

    p.add_argument("--out", required=True, help="directory for ca.pem and <service>.pem / <service>-key.pem")
    p.add_argument("--services", nargs="+", default=list(DEFAULT_SERVICES),
                   help="one certificate each (its name is a SAN too; `up` looks for <process> then <role>)")
    p.add_argument("--hosts", nargs="*", default=[],
                   help="extra SANs (DNS names or IPs) of every certificate; 127.0.0.1, ::1 and localhost "
                        "are always in")
    p.add_argument("--days", type=int, default=365, help="validity of the CA and the certificates")


def run(args: argparse.Namespace) -> int:
    from security.certs import write_dev_certs

    if args.days < 1:
        print("certs: --days must be >= 1", file=sys.stderr)
        return 2
    try:
        made = write_dev_certs(args.out, args.services, hosts=args.hosts, days=args.days)
    except (ValueError, OSError) as e:
        print(f"certs: {e}", file=sys.stderr)
        return 2
    print(f"CA {next(iter(made.values())).ca}")
    for c in made.values():
        print(f"  {c.name:<10} {' '.join(c.flags())}")
    return 0
