"""``add_cluster_auth_args(parser)``: the cluster-identity flags every service takes (one set per
process); read them with ``ClusterCredentials.from_args(args)``."""

from __future__ import annotations

import argparse


def add_cluster_auth_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("cluster identity (docs/security.md)")
    g.add_argument("--tls-cert", default=None,
                   help="PEM certificate of this process, signed by --tls-ca (mTLS: with --tls-key and --tls-ca)")
    g.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    g.add_argument("--tls-ca", default=None,
                   help="PEM CA that signs every cluster service's certificate; peers must present one")
    g.add_argument("--cluster-token", default=None,
                   help="shared cluster token (visible in ps: prefer --cluster-token-file or "
                        "$HALFMOON_CLUSTER_TOKEN)")
    g.add_argument("--cluster-token-file", default=None,
                   help="file whose first line is the cluster token (default: $HALFMOON_CLUSTER_TOKEN)")
