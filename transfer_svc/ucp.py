"""Thin ctypes binding to the public UCP C API (UCX 1.22 headers), just what the transfer engine uses.

Struct layouts mirror `ucp/api/ucp.h` / `ucp_def.h` of the `libucx-cu12` wheel (UCX 1.22; note that
`ucp_request_param_t` is 96 bytes there, 72 in older releases).
`tests/integration/test_transfer_ucp_layout.py` compiles a small C program against the wheel's
headers and compares every size and offset.

Library choice: by default the wheel's `libucp` (`libucx.load_library()`); set `HALFMOON_LIBUCP`
(or pass `libucp=` to `load()`) to the path of another `libucp.so`, e.g. a system UCX built with
verbs (its `libucs` comes in as a dependency).

Every function here must be called from one thread (the engine's progress thread), except
`ucp_worker_signal`, which UCX documents as thread-safe.
"""

from __future__ import annotations

import ctypes
import os
from ctypes import (CFUNCTYPE, POINTER, Structure, Union, byref, c_char_p, c_int, c_int8, c_size_t,
                    c_uint, c_uint32, c_uint64, c_void_p)

# ucs_status_t is a packed enum (UCS_S_PACKED): one signed byte.
c_status = c_int8

# ---- constants (values from the 1.22 headers) ----
UCS_OK = 0
UCS_INPROGRESS = 1
UCS_ERR_BUSY = -15
UCS_ERR_CANCELED = -16
UCS_ERR_TIMED_OUT = -20
UCS_ERR_LAST = -100

UCS_THREAD_MODE_SINGLE = 0
UCS_THREAD_MODE_SERIALIZED = 1
UCS_MEMORY_TYPE_HOST = 0
UCS_MEMORY_TYPE_CUDA = 1

UCP_PARAM_FIELD_FEATURES = 1 << 0
UCP_PARAM_FIELD_NAME = 1 << 8
UCP_FEATURE_RMA = 1 << 1
UCP_FEATURE_WAKEUP = 1 << 4
UCP_FEATURE_AM = 1 << 6

UCP_WORKER_PARAM_FIELD_THREAD_MODE = 1 << 0
UCP_WORKER_PARAM_FIELD_NAME = 1 << 6

UCP_EP_PARAM_FIELD_REMOTE_ADDRESS = 1 << 0
UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE = 1 << 1
UCP_EP_PARAM_FIELD_ERR_HANDLER = 1 << 2
UCP_EP_PARAM_FIELD_USER_DATA = 1 << 3
UCP_ERR_HANDLING_MODE_NONE = 0
UCP_ERR_HANDLING_MODE_PEER = 1
UCP_EP_CLOSE_FLAG_FORCE = 1 << 0

UCP_MEM_MAP_PARAM_FIELD_ADDRESS = 1 << 0
UCP_MEM_MAP_PARAM_FIELD_LENGTH = 1 << 1
UCP_MEM_MAP_PARAM_FIELD_FLAGS = 1 << 2
UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE = 1 << 4

UCP_OP_ATTR_FIELD_REQUEST = 1 << 0
UCP_OP_ATTR_FIELD_CALLBACK = 1 << 1
UCP_OP_ATTR_FIELD_DATATYPE = 1 << 3
UCP_OP_ATTR_FIELD_FLAGS = 1 << 4
UCP_OP_ATTR_FIELD_MEMH = 1 << 8
UCP_OP_ATTR_FLAG_NO_IMM_CMPL = 1 << 16

UCP_AM_SEND_FLAG_EAGER = 1 << 1
UCP_AM_SEND_FLAG_COPY_HEADER = 1 << 3
UCP_AM_HANDLER_PARAM_FIELD_ID = 1 << 0
UCP_AM_HANDLER_PARAM_FIELD_FLAGS = 1 << 1
UCP_AM_HANDLER_PARAM_FIELD_CB = 1 << 2
UCP_AM_HANDLER_PARAM_FIELD_ARG = 1 << 3
UCP_AM_FLAG_WHOLE_MSG = 1 << 0
UCP_AM_RECV_ATTR_FLAG_RNDV = 1 << 17

UCP_DATATYPE_CONTIG = 1 << 3  # ucp_dt_make_contig(1)


# ---- structs ----
class ucs_cpu_set_t(Structure):
    _fields_ = [("ucs_bits", c_uint64 * 16)]  # UCS_CPU_SETSIZE 1024 bits


class ucs_sock_addr_t(Structure):
    _fields_ = [("addr", c_void_p), ("addrlen", c_uint32)]


class ucp_params_t(Structure):
    _fields_ = [("field_mask", c_uint64), ("features", c_uint64), ("request_size", c_size_t),
                ("request_init", c_void_p), ("request_cleanup", c_void_p),
                ("tag_sender_mask", c_uint64), ("mt_workers_shared", c_int),
                ("estimated_num_eps", c_size_t), ("estimated_num_ppn", c_size_t),
                ("name", c_char_p), ("node_local_id", c_size_t)]


class ucp_worker_params_t(Structure):
    _fields_ = [("field_mask", c_uint64), ("thread_mode", c_int), ("cpu_mask", ucs_cpu_set_t),
                ("events", c_uint), ("user_data", c_void_p), ("event_fd", c_int),
                ("flags", c_uint64), ("name", c_char_p), ("am_alignment", c_size_t),
                ("client_id", c_uint64)]


class ucp_err_handler_t(Structure):
    _fields_ = [("cb", c_void_p), ("arg", c_void_p)]


class ucp_ep_params_t(Structure):
    _fields_ = [("field_mask", c_uint64), ("address", c_void_p), ("err_mode", c_int),
                ("err_handler", ucp_err_handler_t), ("user_data", c_void_p), ("flags", c_uint),
                ("sockaddr", ucs_sock_addr_t), ("conn_request", c_void_p), ("name", c_char_p),
                ("local_sockaddr", ucs_sock_addr_t)]


class ucp_mem_map_params_t(Structure):
    _fields_ = [("field_mask", c_uint64), ("address", c_void_p), ("length", c_size_t),
                ("flags", c_uint), ("prot", c_uint), ("memory_type", c_int),
                ("exported_memh_buffer", c_void_p)]


class _cb_union(Union):
    _fields_ = [("send", c_void_p)]


class _recv_info_union(Union):
    _fields_ = [("length", c_void_p)]


class ucp_request_param_t(Structure):
    _fields_ = [("op_attr_mask", c_uint32), ("flags", c_uint32), ("request", c_void_p),
                ("cb", _cb_union), ("datatype", c_uint64), ("user_data", c_void_p),
                ("reply_buffer", c_void_p), ("memory_type", c_int), ("recv_info", _recv_info_union),
                ("memh", c_void_p), ("remote_datatype", c_uint64), ("remote", c_void_p),
                ("remote_count", c_size_t)]


class ucp_am_handler_param_t(Structure):
    _fields_ = [("field_mask", c_uint64), ("id", c_uint), ("flags", c_uint32), ("cb", c_void_p),
                ("arg", c_void_p)]


class ucp_am_recv_param_t(Structure):
    _fields_ = [("recv_attr", c_uint64), ("reply_ep", c_void_p)]


# (struct name in C, ctypes class) — checked by tests/integration/test_transfer_ucp_layout.py
STRUCTS = {
    "ucp_params_t": ucp_params_t,
    "ucp_worker_params_t": ucp_worker_params_t,
    "ucp_ep_params_t": ucp_ep_params_t,
    "ucp_mem_map_params_t": ucp_mem_map_params_t,
    "ucp_request_param_t": ucp_request_param_t,
    "ucp_am_handler_param_t": ucp_am_handler_param_t,
    "ucp_am_recv_param_t": ucp_am_recv_param_t,
    "ucp_err_handler_t": ucp_err_handler_t,
    "ucs_sock_addr_t": ucs_sock_addr_t,
}

# ucs_status_t (*)(void *arg, const void *header, size_t header_length, void *data, size_t length,
#                  const ucp_am_recv_param_t *param)
AM_RECV_CB = CFUNCTYPE(c_status, c_void_p, c_void_p, c_size_t, c_void_p, c_size_t,
                       POINTER(ucp_am_recv_param_t))
# void (*)(void *arg, ucp_ep_h ep, ucs_status_t status)
ERR_HANDLER_CB = CFUNCTYPE(None, c_void_p, c_void_p, c_status)

_P = c_void_p
_SIGNATURES = {
    # name: (restype, argtypes)
    "ucp_get_version": (None, [POINTER(c_uint), POINTER(c_uint), POINTER(c_uint)]),
    "ucp_config_read": (c_status, [c_char_p, c_char_p, POINTER(_P)]),
    "ucp_config_modify": (c_status, [_P, c_char_p, c_char_p]),
    "ucp_config_release": (None, [_P]),
    "ucp_init_version": (c_status, [c_uint, c_uint, POINTER(ucp_params_t), _P, POINTER(_P)]),
    "ucp_cleanup": (None, [_P]),
    "ucp_worker_create": (c_status, [_P, POINTER(ucp_worker_params_t), POINTER(_P)]),
    "ucp_worker_destroy": (None, [_P]),
    "ucp_worker_get_address": (c_status, [_P, POINTER(_P), POINTER(c_size_t)]),
    "ucp_worker_release_address": (None, [_P, _P]),
    "ucp_worker_progress": (c_uint, [_P]),
    "ucp_worker_get_efd": (c_status, [_P, POINTER(c_int)]),
    "ucp_worker_arm": (c_status, [_P]),
    "ucp_worker_signal": (c_status, [_P]),
    "ucp_worker_set_am_recv_handler": (c_status, [_P, POINTER(ucp_am_handler_param_t)]),
    "ucp_ep_create": (c_status, [_P, POINTER(ucp_ep_params_t), POINTER(_P)]),
    "ucp_ep_close_nbx": (_P, [_P, POINTER(ucp_request_param_t)]),
    "ucp_ep_flush_nbx": (_P, [_P, POINTER(ucp_request_param_t)]),
    "ucp_mem_map": (c_status, [_P, POINTER(ucp_mem_map_params_t), POINTER(_P)]),
    "ucp_mem_unmap": (c_status, [_P, _P]),
    "ucp_rkey_pack": (c_status, [_P, _P, POINTER(_P), POINTER(c_size_t)]),
    "ucp_rkey_buffer_release": (None, [_P]),
    "ucp_ep_rkey_unpack": (c_status, [_P, _P, POINTER(_P)]),
    "ucp_rkey_destroy": (None, [_P]),
    "ucp_put_nbx": (_P, [_P, _P, c_size_t, c_uint64, _P, POINTER(ucp_request_param_t)]),
    "ucp_get_nbx": (_P, [_P, _P, c_size_t, c_uint64, _P, POINTER(ucp_request_param_t)]),
    "ucp_am_send_nbx": (_P, [_P, c_uint, _P, c_size_t, _P, c_size_t, POINTER(ucp_request_param_t)]),
    "ucp_request_check_status": (c_status, [_P]),
    "ucp_request_free": (None, [_P]),
    "ucp_request_cancel": (None, [_P, _P]),
}


class UCXError(RuntimeError):
    """A UCP call returned an error status (`status` is the negative ucs_status_t)."""

    def __init__(self, what: str, status: int, text: str):
        super().__init__(f"{what} failed: {text} ({status})")
        self.status = status


class Lib:
    """The loaded `libucp` (+ `libucs` for status strings) with typed functions as attributes."""

    def __init__(self, libucp: str | None = None):
        libucp = libucp or os.environ.get("HALFMOON_LIBUCP") or None
        if libucp:
            # dlsym on libucp's handle also searches its DT_NEEDED libucs (any file name)
            self.ucp = ctypes.CDLL(libucp, ctypes.RTLD_GLOBAL)
            self.ucs = self.ucp
            self.path = libucp
        else:
            import libucx

            libs = libucx.load_library()
            self.ucs, self.ucp = libs[0], libs[3]
            self.path = self.ucp._name
        for name, (res, args) in _SIGNATURES.items():
            fn = getattr(self.ucp, name)
            fn.restype, fn.argtypes = res, args
            setattr(self, name, fn)
        self.ucs.ucs_status_string.restype = c_char_p
        self.ucs.ucs_status_string.argtypes = [c_status]
        major, minor, release = c_uint(), c_uint(), c_uint()
        self.ucp_get_version(byref(major), byref(minor), byref(release))
        # Recorded only: ucp_request_param_t was 72 bytes before 1.22 and ours is the 1.22 one, but
        # the fields we set all lie in the common prefix, so older libraries work too.
        self.version = (major.value, minor.value, release.value)

    def status_string(self, status: int) -> str:
        return self.ucs.ucs_status_string(status).decode()

    def check(self, status: int, what: str) -> None:
        if status != UCS_OK:
            raise UCXError(what, status, self.status_string(status))


def ptr_status(ptr: int | None) -> int:
    """UCS_PTR_STATUS for a returned `ucs_status_ptr_t` (None = UCS_OK, small negative = error,
    anything else = a request handle, reported as UCS_INPROGRESS)."""
    if not ptr:
        return UCS_OK
    if ptr >= (1 << 64) + UCS_ERR_LAST:
        return ptr - (1 << 64)
    return UCS_INPROGRESS


_lib: Lib | None = None


def load(libucp: str | None = None) -> Lib:
    """Load (once per process) and return the UCP library binding."""
    global _lib
    if _lib is None:
        _lib = Lib(libucp)
    elif libucp and libucp != _lib.path:
        raise RuntimeError(f"libucp already loaded from {_lib.path}, cannot switch to {libucp}")
    return _lib
