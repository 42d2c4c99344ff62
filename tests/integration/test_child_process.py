"""A child of ``halfmoon up`` dies with it, even when the launcher is SIGKILLed (PR_SET_PDEATHSIG,
armed by the child itself at start: halfmoon/child_process.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not reaped by its dead parent's reaper yet) counts as gone
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def test_a_child_dies_when_the_launcher_is_sigkilled(tmp_path):
    launcher = textwrap.dedent(f"""
        import re, sys, time
        from pathlib import Path
        from halfmoon.child_process import Proc
        p = Proc("registry", ["serve-transfer", "--host", "127.0.0.1", "--port", "0", "--metrics-port", "-1"],
                 Path({str(tmp_path / "registry.log")!r}), re.compile(r"registry listening"))
        p.start()
        for _ in range(600):
            if p.poll_ready():
                break
            time.sleep(0.1)
        print(p.popen.pid, flush=True)
        time.sleep(600)
    """)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    parent = subprocess.Popen([sys.executable, "-c", launcher], stdout=subprocess.PIPE, text=True, env=env,
                              cwd=ROOT)
    child = 0
    try:
        child = int(parent.stdout.readline())
        assert _alive(child)
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        deadline = time.monotonic() + 15
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(child), "the registry outlived its SIGKILLed launcher"
        assert "Traceback" not in (tmp_path / "registry.log").read_text()
    finally:
        if parent.poll() is None:
            parent.kill()
        if child and _alive(child):
            os.kill(child, signal.SIGKILL)
