"""The credentials ``halfmoon up`` hands its processes (docs/security.md).

Three modes (:class:`AuthMode`):

- ``token`` (the default): an ephemeral cluster token and a router API key, made fresh for each
  ``up`` with :mod:`secrets` and written 0600 into the run dir (``cluster-token``, ``api-keys``).
  Processes get the token as ``--cluster-token-file`` (a path: argv is visible in ``ps``, the token
  itself never is) and the router the key as ``--api-key-file`` (lines ``<tenant> <key>``).
- ``tls``: mTLS between every service: a certificate per process from ``--tls-dir`` (made by
  ``halfmoon certs``: ``<process>.pem``, else ``<role>.pem``) or, without one, a dev CA and
  certificates made into ``<run dir>/certs``. The API key as in ``token``.
- ``open``: no cluster credentials and no API key (the pre-security behaviour; trusted networks only).

Both values are printed in the ENDPOINTS JSON (``cluster_token``, ``api_key``, ``tls``), as Jupyter
prints its token, for the clients on this machine (``halfmoon generate``, ``bench``).
"""

from __future__ import annotations

import enum
import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path

from security import OPEN, ClusterCredentials
from security.call_metadata import bearer_metadata
from security.certs import ServiceCert, write_dev_certs


class AuthMode(str, enum.Enum):
    TOKEN = "token"
    TLS = "tls"
    OPEN = "open"


def _write_private(path: Path, text: str) -> Path:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    return path


@dataclass(frozen=True)
class StackCredentials:
    """What each process of one ``up`` gets, and what clients of it need.

    Attributes:
        mode: the AuthMode.
        cluster_token / token_file: the token and its 0600 file (token mode).
        api_key / api_key_file: the router's API key and its 0600 key file (not open mode).
        certs: process or role name -> ServiceCert (tls mode); "client" is the launcher's own.
    """
    mode: AuthMode
    cluster_token: str | None = field(default=None, repr=False)
    token_file: Path | None = None
    api_key: str | None = field(default=None, repr=False)
    api_key_file: Path | None = None
    certs: dict[str, ServiceCert] = field(default_factory=dict)

    def _cert(self, name: str) -> ServiceCert:
        role = name.split("-")[0]
        cert = self.certs.get(name) or self.certs.get(role)
        if cert is None:
            raise ValueError(f"no certificate for {name!r} (nor {role!r}) in the TLS dir")
        return cert

    def process_args(self, name: str) -> list[str]:
        """Cluster-identity argv of process ``name`` ("registry", "router", "prefill-0", ...)."""
        if self.mode is AuthMode.TLS:
            return self._cert(name).flags()
        if self.mode is AuthMode.TOKEN:
            return ["--cluster-token-file", str(self.token_file)]
        return []

    def router_args(self) -> list[str]:
        """The router's API-key argv (empty in open mode)."""
        if self.api_key_file is None:
            return []
        return ["--api-key-file", str(self.api_key_file)]

    def client(self) -> ClusterCredentials:
        """Credentials for this machine's own calls to workers and registry (tests, tools)."""
        if self.mode is AuthMode.TLS:
            c = self._cert("client")
            return ClusterCredentials.load(tls_cert=str(c.cert), tls_key=str(c.key), tls_ca=str(c.ca))
        return ClusterCredentials(token=self.cluster_token) if self.cluster_token else OPEN

    def router_metadata(self) -> tuple[tuple[str, str], ...]:
        """Call metadata with the API key for the router's gRPC face (empty without a key)."""
        return bearer_metadata(self.api_key) if self.router_args() else ()

    def endpoints_fields(self) -> dict:
        """``auth``, ``cluster_token``, ``api_key`` and ``tls`` (the client's cert paths) for the
        ENDPOINTS JSON."""
        out: dict = {"auth": self.mode.value}
        if self.cluster_token:
            out["cluster_token"] = self.cluster_token
        if self.router_args():
            out["api_key"] = self.api_key
        if self.mode is AuthMode.TLS:
            c = self._cert("client")
            out["tls"] = {"ca": str(c.ca), "cert": str(c.cert), "key": str(c.key)}
        return out


def add_auth_arguments(p) -> None:
    """``up``'s credential flags (``--tls``, ``--no-auth``, ``--tls-dir``); read with :func:`auth_mode`."""
    auth = p.add_mutually_exclusive_group()
    auth.add_argument("--tls", action="store_true",
                      help="mTLS between every service (certificates from --tls-dir, else a dev CA made in "
                           "the log dir) instead of the default ephemeral cluster token")
    auth.add_argument("--no-auth", action="store_true",
                      help="no cluster token, TLS or API key: any local process can join (trusted hosts only)")
    p.add_argument("--tls-dir", default="", help="with --tls: the output of `halfmoon certs` (ca.pem, "
                   "<process>.pem or <role>.pem, and their -key.pem)")


def auth_mode(args) -> AuthMode:
    """The AuthMode of ``up``'s flags (raises SystemExit: --tls-dir without --tls)."""
    if args.tls_dir and not args.tls:
        raise SystemExit("up: --tls-dir needs --tls")
    return AuthMode.TLS if args.tls else AuthMode.OPEN if args.no_auth else AuthMode.TOKEN


def describe(ep: dict) -> list[str]:
    """The credential lines of ``up``'s endpoints table."""
    lines = []
    if ep.get("api_key"):
        lines.append(f"  API key   {ep['api_key']}   (HTTP Authorization: Bearer; gRPC metadata authorization)")
    if ep.get("cluster_token"):
        lines.append(f"  cluster token {ep['cluster_token']}   (metadata x-halfmoon-cluster-token on worker and "
                     f"registry RPCs)")
    if ep.get("tls"):
        lines.append(f"  mTLS      CA {ep['tls']['ca']}   client cert {ep['tls']['cert']}")
    return lines


def prepare(mode: AuthMode, run_dir: Path, names: list[str], *, tls_dir: str = "",
            hosts: tuple[str, ...] = ()) -> StackCredentials:
    """Make the credentials of one ``up`` in ``run_dir`` for processes ``names``.

    Raises:
        ValueError: ``tls_dir`` lacks a CA or a certificate for a process (named).
    """
    if mode is AuthMode.OPEN:
        return StackCredentials(mode)
    api_key = "hm-" + secrets.token_urlsafe(24)
    key_file = _write_private(run_dir / "api-keys", f"default {api_key}\n")
    if mode is AuthMode.TOKEN:
        token = secrets.token_urlsafe(32)
        return StackCredentials(mode, token, _write_private(run_dir / "cluster-token", token + "\n"),
                                api_key, key_file)
    if tls_dir:
        d = Path(tls_dir)
        if not (d / "ca.pem").is_file():
            raise ValueError(f"--tls-dir {d}: no ca.pem (make one: halfmoon certs --out {d})")
        certs = {p.stem: ServiceCert(p.stem, p, d / f"{p.stem}-key.pem", d / "ca.pem")
                 for p in d.glob("*.pem") if p.stem != "ca" and not p.stem.endswith("-key")}
    else:
        certs = write_dev_certs(run_dir / "certs", [*names, "client"], hosts=hosts)
    creds = StackCredentials(mode, api_key=api_key, api_key_file=key_file, certs=certs)
    for n in [*names, "client"]:
        creds._cert(n)
    return creds


__all__ = ["AuthMode", "StackCredentials", "add_auth_arguments", "auth_mode", "describe", "prepare"]
