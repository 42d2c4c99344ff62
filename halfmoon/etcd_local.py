"""A local single-member etcd (Debian's `etcd-server`, installed by scripts/install-tools.sh) on
loopback, for `halfmoon up --registry etcd` and the tests: free ports, its own data directory,
stopped by its pid.

    with LocalEtcd(data_dir) as etcd:
        etcd.endpoint            # "127.0.0.1:PORT" for --etcd-endpoints
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def etcd_binary() -> str | None:
    """Path of the etcd server binary (ETCD_BIN, else PATH), or None."""
    return os.environ.get("ETCD_BIN") or shutil.which("etcd")


class LocalEtcd:
    """Args: data_dir: etcd's data directory (kept: a restart on it keeps the keys);
    client_port: 0 = a free port (kept across restart()); log: file for etcd's output.
    Raises FileNotFoundError without the binary, TimeoutError if it does not become healthy."""

    def __init__(self, data_dir: str | Path, *, client_port: int = 0, log: str | Path | None = None,
                 start_timeout_s: float = 30.0):
        self.binary = etcd_binary()
        if self.binary is None:
            raise FileNotFoundError("etcd not found: run scripts/install-tools.sh (Debian etcd-server)")
        self.data_dir = Path(data_dir)
        self.client_port = client_port or _free_port()
        self.peer_port = _free_port()
        self.log = Path(log) if log else self.data_dir.with_suffix(".log")
        self.start_timeout_s = start_timeout_s
        self.proc: subprocess.Popen | None = None
        self.start()

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    def start(self) -> None:
        client = f"http://127.0.0.1:{self.client_port}"
        peer = f"http://127.0.0.1:{self.peer_port}"
        argv = [self.binary, "--name", "halfmoon", "--data-dir", str(self.data_dir),
                "--listen-client-urls", client, "--advertise-client-urls", client,
                "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                "--initial-cluster", f"halfmoon={peer}", "--initial-cluster-state", "new"]
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        deadline = time.monotonic() + self.start_timeout_s
        while True:
            try:
                with urllib.request.urlopen(f"{client}/health", timeout=1) as r:
                    if b'"true"' in r.read():
                        return
            except OSError:
                pass
            if self.proc.poll() is not None:
                raise RuntimeError(f"etcd exited with {self.proc.returncode}; see {self.log}")
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"etcd not healthy after {self.start_timeout_s}s; see {self.log}")
            time.sleep(0.1)

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(sig)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def restart(self, sig: int = signal.SIGKILL) -> None:
        """Stop (SIGKILL by default) and start again on the same ports and data."""
        self.stop(sig)
        self.start()

    def __enter__(self) -> "LocalEtcd":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
