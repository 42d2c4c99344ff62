"""ClusterCredentials: how one halfmoon process proves it belongs to the cluster and checks that
its peers do: mutual TLS (a cert + key signed by the cluster CA, and that CA), a shared cluster
token, both, or neither (an open cluster, the pre-security behaviour; only for trusted networks).

    creds = ClusterCredentials.from_args(args)          # flags of security.flags, env, files
    server = grpc.server(pool, interceptors=creds.server_interceptors() + [InvalidRequestInterceptor()])
    port = creds.add_port(server, "127.0.0.1:0")        # TLS port (client certs required) or plain
    stub = PrefillStub(creds.channel("127.0.0.1:7001"))  # verifies the server; sends cert / token
    ch = creds.aio_channel(address, options=[...])       # the same for grpc.aio

The token is never part of ``repr`` and is never logged. Sources, first found wins: ``--cluster-token``,
``--cluster-token-file`` (first line), ``$HALFMOON_CLUSTER_TOKEN``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

import grpc

from security.token_interceptor import TOKEN_METADATA_KEY, AioTokenInterceptor, TokenInterceptor
from security.call_metadata import MetadataClientInterceptor, aio_metadata_interceptors

TOKEN_ENV = "HALFMOON_CLUSTER_TOKEN"
MIN_TOKEN_CHARS = 16


class CredentialsError(ValueError):
    """Credentials that cannot be used; the message names the flag and the file."""


def _read(path: str, flag: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise CredentialsError(f"{flag} {path}: {e.strerror or e}") from None


@dataclass(frozen=True)
class TlsFiles:
    """PEM bytes of this process's certificate chain, its private key and the cluster CA, checked
    at load: each parses, and the key belongs to the certificate."""
    cert_path: str
    key_path: str
    ca_path: str
    cert: bytes = field(repr=False)
    key: bytes = field(repr=False)
    ca: bytes = field(repr=False)

    @classmethod
    def load(cls, cert: str, key: str, ca: str) -> "TlsFiles":
        """Raises CredentialsError naming the flag and file that is missing, unreadable or not PEM."""
        from cryptography import x509
        from cryptography.hazmat.primitives import serialization

        data = {flag: _read(path, flag) for flag, path in (("--tls-cert", cert), ("--tls-key", key),
                                                           ("--tls-ca", ca))}
        try:
            leaf = x509.load_pem_x509_certificate(data["--tls-cert"])
        except ValueError as e:
            raise CredentialsError(f"--tls-cert {cert}: not a PEM certificate ({e})") from None
        try:
            x509.load_pem_x509_certificates(data["--tls-ca"])
        except ValueError as e:
            raise CredentialsError(f"--tls-ca {ca}: not a PEM certificate ({e})") from None
        try:
            private = serialization.load_pem_private_key(data["--tls-key"], password=None)
        except (ValueError, TypeError) as e:
            raise CredentialsError(f"--tls-key {key}: not an unencrypted PEM private key ({e})") from None
        pub = serialization.PublicFormat.SubjectPublicKeyInfo
        if private.public_key().public_bytes(serialization.Encoding.DER, pub) != \
                leaf.public_key().public_bytes(serialization.Encoding.DER, pub):
            raise CredentialsError(f"--tls-key {key} is not the key of --tls-cert {cert}")
        return cls(cert, key, ca, data["--tls-cert"], data["--tls-key"], data["--tls-ca"])


@dataclass(frozen=True)
class ClusterCredentials:
    """What this process presents to and demands from its cluster peers.

    Attributes:
        token: the shared cluster token (None: no token check / none sent).
        tls: this process's cert, key and the CA (None: plaintext gRPC).
    """
    token: str | None = field(default=None, repr=False)
    tls: TlsFiles | None = None

    @classmethod
    def load(cls, *, token: str | None = None, token_file: str | None = None, tls_cert: str | None = None,
             tls_key: str | None = None, tls_ca: str | None = None,
             env: Mapping[str, str] = os.environ) -> "ClusterCredentials":
        """Credentials from explicit values, a token file and ``env``.

        Raises:
            CredentialsError: a missing or unreadable file, a token shorter than 16 characters, or
                only some of --tls-cert / --tls-key / --tls-ca.
        """
        if token is None and token_file:
            lines = _read(token_file, "--cluster-token-file").decode(errors="replace").splitlines()
            token = lines[0].strip() if lines else ""
            if not token:
                raise CredentialsError(f"--cluster-token-file {token_file}: the file is empty")
        if token is None:
            token = env.get(TOKEN_ENV) or None
        if token is not None and len(token) < MIN_TOKEN_CHARS:
            raise CredentialsError(f"the cluster token must have at least {MIN_TOKEN_CHARS} characters "
                                   f"(generate one: python -c 'import secrets; print(secrets.token_urlsafe(32))')")
        tls_given = [f for f, v in (("--tls-cert", tls_cert), ("--tls-key", tls_key), ("--tls-ca", tls_ca)) if v]
        if tls_given and len(tls_given) != 3:
            missing = sorted({"--tls-cert", "--tls-key", "--tls-ca"} - set(tls_given))
            raise CredentialsError(f"{', '.join(tls_given)} given without {', '.join(missing)}: mTLS needs all three")
        tls = TlsFiles.load(tls_cert, tls_key, tls_ca) if tls_given else None
        return cls(token=token, tls=tls)

    @classmethod
    def from_args(cls, args, env: Mapping[str, str] = os.environ) -> "ClusterCredentials":
        """From the flags of :func:`security.flags.add_cluster_auth_args` (raises CredentialsError)."""
        return cls.load(token=args.cluster_token, token_file=args.cluster_token_file, tls_cert=args.tls_cert,
                        tls_key=args.tls_key, tls_ca=args.tls_ca, env=env)

    @property
    def mode(self) -> str:
        """"mtls", "token", "mtls+token" or "open" (for logs; never the token itself)."""
        parts = [name for name, on in (("mtls", self.tls), ("token", self.token)) if on]
        return "+".join(parts) or "open"

    # ---- server side
    def server_credentials(self) -> grpc.ServerCredentials | None:
        """TLS server credentials that require and verify a client cert signed by the CA (None
        without TLS)."""
        if self.tls is None:
            return None
        return grpc.ssl_server_credentials([(self.tls.key, self.tls.cert)], root_certificates=self.tls.ca,
                                           require_client_auth=True)

    def add_port(self, server, address: str) -> int:
        """Bind ``address`` on a ``grpc.server`` / ``grpc.aio.server``: TLS or plaintext -> port (0:
        the bind failed)."""
        creds = self.server_credentials()
        return server.add_insecure_port(address) if creds is None else server.add_secure_port(address, creds)

    def server_interceptors(self) -> list[grpc.ServerInterceptor]:
        """The token check for a ``grpc.server`` (empty without a token); put it first."""
        return [TokenInterceptor(self.token)] if self.token else []

    def aio_server_interceptors(self) -> list:
        """The token check for a ``grpc.aio.server`` (empty without a token); put it first."""
        return [AioTokenInterceptor(self.token)] if self.token else []

    # ---- client side
    def channel_credentials(self) -> grpc.ChannelCredentials | None:
        """TLS channel credentials: verify the server against the CA, present our cert (None
        without TLS)."""
        if self.tls is None:
            return None
        return grpc.ssl_channel_credentials(root_certificates=self.tls.ca, private_key=self.tls.key,
                                            certificate_chain=self.tls.cert)

    def metadata(self) -> tuple[tuple[str, str], ...]:
        """Call metadata carrying the token (empty without one), for calls made on channels not
        built here."""
        return ((TOKEN_METADATA_KEY, self.token),) if self.token else ()

    def channel(self, address: str, options=None) -> grpc.Channel:
        """A sync channel to a cluster service at ``host:port``."""
        creds = self.channel_credentials()
        ch = grpc.insecure_channel(address, options) if creds is None else \
            grpc.secure_channel(address, creds, options)
        return grpc.intercept_channel(ch, MetadataClientInterceptor(self.metadata())) if self.token else ch

    def aio_channel(self, address: str, options=None) -> grpc.aio.Channel:
        """A ``grpc.aio`` channel to a cluster service at ``host:port`` (inside an event loop)."""
        creds = self.channel_credentials()
        interceptors = aio_metadata_interceptors(self.metadata()) if self.token else None
        if creds is None:
            return grpc.aio.insecure_channel(address, options, interceptors=interceptors)
        return grpc.aio.secure_channel(address, creds, options, interceptors=interceptors)


OPEN = ClusterCredentials()

__all__ = ["OPEN", "TOKEN_ENV", "TOKEN_METADATA_KEY", "ClusterCredentials", "CredentialsError", "TlsFiles"]
