"""One child process of ``halfmoon up``: ``python -m halfmoon <serve-...>`` in its own session
(process group) that arms ``PR_SET_PDEATHSIG`` itself at start (:func:`arm_parent_death_signal`), so
it dies with the launcher even on SIGKILL; output to its log file; ready when its ready line appears
there."""

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


PARENT_ENV = "HALFMOON_PARENT_PID"


def arm_parent_death_signal() -> None:
    """In a child of ``halfmoon up`` (``$HALFMOON_PARENT_PID`` set): SIGTERM this process when the
    launcher dies, even by SIGKILL (``PR_SET_PDEATHSIG``), and exit at once if it already has.

    Done by the child at start, not in a ``preexec_fn``: a ``preexec_fn`` makes ``subprocess`` run
    Python's at-fork handlers in the forked child of a multi-threaded process, and one of a library
    (filelock's) crashed that child with SIGSEGV.
    """
    parent = os.environ.pop(PARENT_ENV, "")
    if not parent:
        return
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != int(parent):  # the launcher died before the signal was armed
        os.kill(os.getpid(), signal.SIGTERM)


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
        env = dict(os.environ, PYTHONUNBUFFERED="1", **self.extra_env, **{PARENT_ENV: str(os.getpid())})
        env.pop(TOKEN_ENV, None)  # the launcher's credentials decide (halfmoon.stack_credentials), not ours
        with open(self.log, "wb") as out:
            self.popen = subprocess.Popen([sys.executable, "-m", "halfmoon", *self.argv], stdout=out,
                                          stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                          start_new_session=True, cwd=os.getcwd())

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
