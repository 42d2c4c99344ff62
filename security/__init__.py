"""Cluster identity between halfmoon's own services: mTLS or a shared cluster token on every
worker and registry RPC (docs/security.md). Ground layer: imports only ``protos``."""

from security.cluster_credentials import (OPEN, TOKEN_ENV, TOKEN_METADATA_KEY, ClusterCredentials,
                                          CredentialsError, TlsFiles)

__all__ = ["OPEN", "TOKEN_ENV", "TOKEN_METADATA_KEY", "ClusterCredentials", "CredentialsError", "TlsFiles"]
