"""One child process of ``halfmoon up``: ``python -m halfmoon <serve-...>`` in its own session
(process group) with ``PR_SET_PDEATHSIG``, so it dies with the launcher even on SIGKILL; output to its
log file; ready when its ready line appears there."""

from __future__ import annotations

import ctypes
import os
import re
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from security import TOKEN_ENV


try:  # loaded here, in the parent: the child between fork and exec must not dlopen (lock held by a thread)
    _prctl = ctypes.CDLL("libc.so.6", use_errno=True).prctl
except (OSError, AttributeError):
    _prctl = None


def _pdeathsig() -> None:
    """Runs in the child between fork and exec: SIGTERM it when the launcher dies (PR_SET_PDEATHSIG)."""
    if _prctl is not None:
        _prctl(1, signal.SIGTERM)


@dataclass
class Proc:
    name: str
    argv: list[str]
    log: Path
    ready_re: re.Pattern
    popen: subprocess.Popen | None = None
    match: re.Match | None = None
    extra_env: dict = field(default_factory=dict)

    def start(self) -> None:
        env = dict(os.environ, PYTHONUNBUFFERED="1", **self.extra_env)
        env.pop(TOKEN_ENV, None)  # the launcher's credentials decide (halfmoon.stack_credentials), not ours
        with open(self.log, "wb") as out:
            self.popen = subprocess.Popen([sys.executable, "-m", "halfmoon", *self.argv], stdout=out,
                                          stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                          start_new_session=True, preexec_fn=_pdeathsig, cwd=os.getcwd())

    def poll_ready(self) -> bool:
        if self.match is None:
            m = self.ready_re.search(self.log.read_text(errors="replace"))
            self.match = m
        return self.match is not None

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def signal(self, sig: int) -> None:
        if self.alive():
            try:
                os.killpg(self.popen.pid, sig)
            except ProcessLookupError:
                pass
