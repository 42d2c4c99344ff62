"""ctypes struct layouts in transfer_svc/ucp.py == the C layouts of the libucp headers we load.

Compiles a small C program with gcc against the `libucx` wheel's headers and compares sizeof and
every field's offsetof with the ctypes classes.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess

import pytest

from transfer_svc import ucp


# scalar/enum types whose width the binding assumes (ucs_status_t is a packed, one-byte enum)
TYPES = {
    "ucs_status_t": ucp.c_status,
    "ucs_memory_type_t": ctypes.c_int,
    "ucs_thread_mode_t": ctypes.c_int,
    "ucp_err_handling_mode_t": ctypes.c_int,
    "ucp_datatype_t": ctypes.c_uint64,
}


def _include_dir() -> str:
    import libucx

    return os.path.join(os.path.dirname(libucx.__file__), "include")


@pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")
def test_struct_layouts_match_headers(tmp_path):
    lines = ['#include <stdio.h>', '#include <stddef.h>', '#include <ucp/api/ucp.h>',
             'int main(void) {']
    for cname, cls in ucp.STRUCTS.items():
        lines.append(f'printf("{cname} sizeof %zu\\n", sizeof({cname}));')
        for field, _ in cls._fields_:
            lines.append(f'printf("{cname} {field} %zu\\n", offsetof({cname}, {field}));')
    for ctype, pytype in TYPES.items():
        lines.append(f'printf("{ctype} sizeof %zu\\n", sizeof({ctype}));')
    lines += ['return 0;', '}']
    src = tmp_path / "layout.c"
    src.write_text("\n".join(lines))
    exe = tmp_path / "layout"
    subprocess.run(["gcc", "-I", _include_dir(), str(src), "-o", str(exe)], check=True,
                   capture_output=True)
    out = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout
    c_values = {}
    for line in out.splitlines():
        cname, field, value = line.split()
        c_values[(cname, field)] = int(value)
    mismatches = []
    for cname, cls in ucp.STRUCTS.items():
        if c_values[(cname, "sizeof")] != ctypes.sizeof(cls):
            mismatches.append(f"sizeof {cname}: C {c_values[(cname, 'sizeof')]} ctypes {ctypes.sizeof(cls)}")
        for field, _ in cls._fields_:
            off = getattr(cls, field).offset
            if c_values[(cname, field)] != off:
                mismatches.append(f"{cname}.{field}: C {c_values[(cname, field)]} ctypes {off}")
    for ctype, pytype in TYPES.items():
        if c_values[(ctype, "sizeof")] != ctypes.sizeof(pytype):
            mismatches.append(f"sizeof {ctype}: C {c_values[(ctype, 'sizeof')]} ctypes {ctypes.sizeof(pytype)}")
    assert not mismatches, mismatches
    assert c_values[("ucp_request_param_t", "sizeof")] == 96  # the 1.22 layout


def test_library_version_matches_headers():
    lib = ucp.load()
    assert lib.version[:2] == (1, 22)


def test_another_libucp_can_be_chosen(tmp_path):
    """HALFMOON_LIBUCP points the binding at a given libucp.so (here: the wheel's, by path)."""
    import subprocess
    import sys

    path = os.path.join(_include_dir(), "..", "lib", "libucp.so")
    code = ("from transfer_svc import TransferEngine, ucp; "
            "e = TransferEngine('x', transports='tcp'); print(ucp.load().path); e.close()")
    env = dict(os.environ, HALFMOON_LIBUCP=os.path.abspath(path))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=60, cwd=os.path.dirname(os.path.dirname(os.path.dirname(
                             os.path.abspath(__file__)))))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == os.path.abspath(path)
