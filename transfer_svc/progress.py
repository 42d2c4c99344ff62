"""The progress thread: the one thread that owns the UCP context, the worker and every UCP call.

UCP runs in single-thread mode, so nothing else may call it. Callers validate their arguments in
their own thread (bounds checks raise before UCX sees anything), then hand a closure to this thread
(`call` waits for its result, `post` does not) and wake it through an eventfd. When idle, the thread
sleeps in poll() on the worker's event fd (armed with `ucp_worker_arm`; UCS_ERR_BUSY means
"progress again first") and the eventfd, so an idle engine burns no CPU; it keeps progressing while
work is pending, which also makes it a progressing *target* for tcp peers.

Requests that nobody waits for any more (of failed batches, of endpoint closes) are kept as
orphans and freed once UCX completes them: freeing a request UCX still uses would corrupt it.
"""

from __future__ import annotations

import abc
import collections
import ctypes
import logging
import os
import select
import threading
import time
from concurrent.futures import Future
from typing import Callable, Mapping, NamedTuple

from transfer_svc import ucp
from transfer_svc.types import TransferError

log = logging.getLogger(__name__)

AmHandler = Callable[[bytes, bytes], None]  # (header, payload) of one received active message


class LoopWork(abc.ABC):
    """What the loop drives besides UCX itself: batches that wait on a UCX request."""

    @abc.abstractmethod
    def has_inflight(self) -> bool:
        """Whether any batch waits on a UCX request (the loop then wakes at least every 50 ms)."""

    @abc.abstractmethod
    def soonest_deadline(self) -> float:
        """time.monotonic() seconds of the earliest deadline among those batches."""

    @abc.abstractmethod
    def check_inflight(self) -> None:
        """Finish the batches whose requests completed or whose deadline passed."""


class _Command(NamedTuple):
    fn: Callable
    args: tuple
    future: Future | None                                # None: posted, nobody waits
    on_error: Callable[[BaseException], None] | None     # posted only: told why fn raised


class WorkerConfig(NamedTuple):
    """How the UCP context and worker are made."""

    name: str                # engine name: UCP context name, thread name
    transports: str | None   # UCX_TLS ("sm", "tcp", ...); None leaves UCX's own choice
    tcp_sockbuf: str         # UCX_TCP_SNDBUF / RCVBUF unless set in the environment; "" leaves them


class ProgressThread:
    """Owns the UCP context and worker; runs closures on its thread. Construct, then `start`.

    Args:
        lib: the loaded UCP binding.
        config: context and worker settings.
        spin_s: seconds the thread keeps polling after activity before it sleeps.
        busy_poll: keep polling (no sleep) while batches are in flight.
    """

    def __init__(self, lib: ucp.Lib, config: WorkerConfig, *, spin_s: float, busy_poll: bool):
        self.lib = lib
        self.config = config
        self.spin_s = spin_s
        self.busy_poll = busy_poll
        self.ctx = ctypes.c_void_p()
        self.worker = ctypes.c_void_p()
        self.worker_address = b""
        self._cmds: collections.deque[_Command] = collections.deque()
        self._orphans: list[int] = []
        self._wake_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._stop = False
        self.closed = False
        self._am_cbs: list = []  # ctypes callbacks must outlive the worker
        self.thread: threading.Thread | None = None

    def start(self, work: LoopWork, teardown: Callable[[], None],
              am_handlers: Mapping[int, AmHandler]) -> None:
        """Start the thread and wait until the worker exists (UCXError if UCX refuses).

        work: polled every loop turn. teardown: runs on this thread once close() stopped the loop,
        before the worker is destroyed. am_handlers: active-message id -> handler of whole eager
        messages (rendezvous ones are dropped); a handler must not raise (it runs inside UCX)."""
        started: Future = Future()
        self.thread = threading.Thread(target=self._run,
                                       args=(work, teardown, am_handlers, started),
                                       name=f"ucx-progress-{self.config.name}", daemon=True)
        self.thread.start()
        started.result()

    def close(self) -> None:
        """Stop the loop, run teardown and destroy the worker; join the thread (10 s at most)."""
        if self.closed:
            return
        self.closed = True
        self._stop = True
        self._wake()
        self.thread.join(timeout=10)
        os.close(self._wake_fd)

    # ------------------------------------------------------------------ caller side
    def call(self, fn: Callable, *args):
        """Run fn(*args) on the progress thread and return its result (or raise its exception);
        TransferError if the engine is closed."""
        if self.closed:
            raise TransferError("engine is closed")
        fut: Future = Future()
        self._cmds.append(_Command(fn, args, fut, None))
        self._wake()
        return fut.result()

    def post(self, fn: Callable, *args, on_error: Callable[[BaseException], None] | None = None
             ) -> None:
        """Queue fn(*args) for the progress thread without waiting; if it raises, the error is
        logged and handed to on_error (on that thread). TransferError if the engine is closed."""
        if self.closed:
            raise TransferError("engine is closed")
        self._cmds.append(_Command(fn, args, None, on_error))
        self._wake()

    def _wake(self) -> None:
        try:
            os.eventfd_write(self._wake_fd, 1)
        except OSError:
            pass

    # ------------------------------------------------------------------ thread side
    def orphan(self, req: int) -> None:
        """Free UCP request `req` once UCX completes it (progress thread only)."""
        self._orphans.append(req)

    def drain_orphans(self, seconds: float) -> None:
        """Progress until every orphaned request completed, `seconds` at most (teardown)."""
        deadline = time.monotonic() + seconds
        while self._orphans and time.monotonic() < deadline:
            self.lib.ucp_worker_progress(self.worker)
            self._reap_orphans()

    def _reap_orphans(self) -> None:
        keep = []
        for req in self._orphans:
            if self.lib.ucp_request_check_status(req) == ucp.UCS_INPROGRESS:
                keep.append(req)
            else:
                self.lib.ucp_request_free(req)
        self._orphans = keep

    def _setup(self, am_handlers: Mapping[int, AmHandler]) -> None:
        lib = self.lib
        config = ctypes.c_void_p()
        lib.check(lib.ucp_config_read(None, None, ctypes.byref(config)), "ucp_config_read")
        try:
            transports, sockbuf = self.config.transports, self.config.tcp_sockbuf
            if transports:
                lib.check(lib.ucp_config_modify(config, b"TLS", transports.encode()), "UCX_TLS")
            for key in ("TCP_SNDBUF", "TCP_RCVBUF"):
                if f"UCX_{key}" not in os.environ and sockbuf:
                    lib.check(lib.ucp_config_modify(config, key.encode(), sockbuf.encode()), key)
            params = ucp.ucp_params_t()
            params.field_mask = ucp.UCP_PARAM_FIELD_FEATURES | ucp.UCP_PARAM_FIELD_NAME
            params.features = ucp.UCP_FEATURE_RMA | ucp.UCP_FEATURE_AM | ucp.UCP_FEATURE_WAKEUP
            params.name = self.config.name.encode()
            lib.check(lib.ucp_init_version(1, 22, ctypes.byref(params), config,
                                           ctypes.byref(self.ctx)), "ucp_init")
        finally:
            lib.ucp_config_release(config)
        wp = ucp.ucp_worker_params_t()
        wp.field_mask = ucp.UCP_WORKER_PARAM_FIELD_THREAD_MODE
        wp.thread_mode = ucp.UCS_THREAD_MODE_SINGLE
        lib.check(lib.ucp_worker_create(self.ctx, ctypes.byref(wp), ctypes.byref(self.worker)),
                  "ucp_worker_create")
        addr, alen = ctypes.c_void_p(), ctypes.c_size_t()
        lib.check(lib.ucp_worker_get_address(self.worker, ctypes.byref(addr), ctypes.byref(alen)),
                  "ucp_worker_get_address")
        self.worker_address = ctypes.string_at(addr, alen.value)
        lib.ucp_worker_release_address(self.worker, addr)
        efd = ctypes.c_int()
        lib.check(lib.ucp_worker_get_efd(self.worker, ctypes.byref(efd)), "ucp_worker_get_efd")
        self._efd = efd.value
        for am_id, handler in am_handlers.items():
            cb = ucp.AM_RECV_CB(_am_trampoline(handler))
            self._am_cbs.append(cb)
            hp = ucp.ucp_am_handler_param_t()
            hp.field_mask = (ucp.UCP_AM_HANDLER_PARAM_FIELD_ID
                             | ucp.UCP_AM_HANDLER_PARAM_FIELD_FLAGS
                             | ucp.UCP_AM_HANDLER_PARAM_FIELD_CB)
            hp.id = am_id
            hp.flags = ucp.UCP_AM_FLAG_WHOLE_MSG
            hp.cb = ctypes.cast(cb, ctypes.c_void_p)
            lib.check(lib.ucp_worker_set_am_recv_handler(self.worker, ctypes.byref(hp)),
                      "ucp_worker_set_am_recv_handler")

    def _run_commands(self) -> bool:
        """Run every queued closure; True if there was any."""
        busy = False
        while self._cmds:
            fn, args, fut, on_error = self._cmds.popleft()
            try:
                res = fn(*args)
                if fut is not None:
                    fut.set_result(res)
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                if fut is not None:
                    fut.set_exception(e)
                else:
                    log.exception("transfer engine: posted work failed")
                    if on_error is not None:
                        on_error(e)
            busy = True
        return busy

    def _run(self, work: LoopWork, teardown: Callable[[], None],
             am_handlers: Mapping[int, AmHandler], started: Future) -> None:
        try:
            self._setup(am_handlers)
        except BaseException as e:  # noqa: BLE001 - reported to start()
            started.set_exception(e)
            return
        started.set_result(None)
        lib, worker = self.lib, self.worker
        poller = select.poll()
        poller.register(self._efd, select.POLLIN)
        poller.register(self._wake_fd, select.POLLIN)
        last_activity = time.monotonic()
        while True:
            busy = self._run_commands()
            if self._stop:
                break
            while lib.ucp_worker_progress(worker):
                busy = True
            try:
                if work.has_inflight():
                    work.check_inflight()
                if self._orphans:
                    self._reap_orphans()
            except Exception:  # noqa: BLE001 - keep the progress thread alive
                log.exception("transfer engine: completion check failed")
            now = time.monotonic()
            if busy:
                last_activity = now
                continue
            if (self._cmds or now - last_activity < self.spin_s
                    or (self.busy_poll and work.has_inflight())):
                continue
            if lib.ucp_worker_arm(worker) == ucp.UCS_ERR_BUSY:
                continue
            if work.has_inflight():
                timeout_ms = max(0, min(50, int((work.soonest_deadline() - now) * 1000) + 1))
            elif self._orphans:
                timeout_ms = 50
            else:
                timeout_ms = 1000
            for fd, _ in poller.poll(timeout_ms):
                if fd == self._wake_fd:
                    try:
                        os.eventfd_read(self._wake_fd)
                    except BlockingIOError:
                        pass
        try:
            teardown()
            lib.ucp_worker_destroy(self.worker)
            lib.ucp_cleanup(self.ctx)
        finally:
            # release callers waiting on commands queued after stop
            while self._cmds:
                fut = self._cmds.popleft().future
                if fut is not None:
                    fut.set_exception(TransferError("engine is closed"))


def _am_trampoline(handler: AmHandler) -> Callable[..., int]:
    """The C-level AM callback around `handler`: copies header and payload out of UCX's buffers."""

    def on_am(arg, header, header_length, data, length, param) -> int:
        try:
            if param and param.contents.recv_attr & ucp.UCP_AM_RECV_ATTR_FLAG_RNDV:
                return ucp.UCS_OK  # senders here use eager only; a rendezvous message is dropped
            handler(ctypes.string_at(header, header_length), ctypes.string_at(data, length))
        except Exception:  # noqa: BLE001 - never raise into C
            pass
        return ucp.UCS_OK

    return on_am
