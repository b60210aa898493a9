"""A recording stand-in for the step's side streams, with an ordering checker, so the accelerator
code paths (`if streams.active`) run on CPU and a missing wait or a wrong order fails a test.

`RecordingStreams` replaces `zeroshard.dist.streams.Streams` (build.py makes the engine's one
instance): it claims to be active, keeps a current stream ("compute" or a side stream inside
`on(name)`) and models each stream as a vector clock. `OrderChecker`, a dispatch mode, sees every
operator the main thread runs and attributes it to the current stream; collectives (c10d
operators) run on a stream of their own that starts after the issuing stream's work, as NCCL's
do, and a handle's `wait()` orders the stream current at that moment after the collective.
Events snapshot a stream's clock; waiting for one merges it; a host wait (`event.synchronize()`)
orders every later operation after it.

An operator that reads a tensor another stream wrote, or writes a tensor another stream read or
wrote, without being ordered after that access, is recorded as a race (tensors are told apart by
their storage; a freshly allocated output starts a new history).
"""

from __future__ import annotations

import contextlib
import threading

import torch
from torch.utils._python_dispatch import TorchDispatchMode

COMPUTE = "compute"


class OrderChecker(TorchDispatchMode):
    """Vector clocks per stream; the races found and the operators counted per stream."""

    def __init__(self):
        super().__init__()
        self.lock = threading.Lock()
        self.clocks: dict[str, dict[str, int]] = {COMPUTE: {COMPUTE: 0}}
        self.current = COMPUTE
        self.writes: dict[int, tuple[str, int, str]] = {}  # storage -> (stream, time, op)
        self.reads: dict[int, dict[str, tuple[int, str]]] = {}  # storage -> stream -> (time, op)
        self.races: list[str] = []
        self.ops: dict[str, int] = {}
        #: The stream of the collective being issued through a Comm (None: not issuing one; the
        #: operators of one collective, e.g. its sends and receives, share it).
        self.issuing: str | None = None
        self.collectives = 0
        #: (stream that last wrote it, stream reading it) of each tensor handed to
        #: `Streams.keep_until_used` (memory made on one stream, dropped after another reads it).
        self.kept: list[tuple[str | None, str]] = []

    # -- clocks ----------------------------------------------------------------------------------
    def clock(self, stream: str) -> dict[str, int]:
        """`stream`'s vector clock (made on first use)."""
        return self.clocks.setdefault(stream, {stream: 0})

    def merge(self, into: str, snapshot: dict[str, int]) -> None:
        """Order `into`'s later work after everything `snapshot` covers."""
        with self.lock:
            clock = self.clock(into)
            for stream, time in snapshot.items():
                clock[stream] = max(clock.get(stream, 0), time)

    def snapshot(self, stream: str) -> dict[str, int]:
        """A copy of `stream`'s clock (what an event recorded now covers)."""
        with self.lock:
            return dict(self.clock(stream))

    def host_wait(self, snapshot: dict[str, int]) -> None:
        """The host waited: everything queued from now on, on any stream, comes after."""
        for stream in list(self.clocks):
            if not stream.startswith("comm#"):
                self.merge(stream, snapshot)

    def begin_issue(self) -> None:
        """A Comm starts issuing one collective."""
        self.collectives += 1
        self.issuing = f"comm#{self.collectives}"

    def end_issue(self) -> str:
        """The collective is issued: its stream, for the handle's `wait()`."""
        stream, self.issuing = self.issuing, None
        return stream

    # -- accesses ----------------------------------------------------------------------------------
    def _tick(self, stream: str) -> int:
        clock = self.clock(stream)
        clock[stream] += 1
        self.ops[stream.split("#")[0]] = self.ops.get(stream.split("#")[0], 0) + 1
        return clock[stream]

    def _ordered(self, stream: str, other: str, time: int) -> bool:
        return other == stream or self.clock(stream).get(other, 0) >= time

    def _read(self, stream: str, key: int, time: int, op: str) -> None:
        last = self.writes.get(key)
        if last is not None and not self._ordered(stream, last[0], last[1]):
            self.races.append(f"{op} on {stream} reads what {last[2]} on {last[0]} wrote, "
                              "without waiting for it")
        self.reads.setdefault(key, {})[stream] = (time, op)

    def _write(self, stream: str, key: int, time: int, op: str) -> None:
        last = self.writes.get(key)
        if last is not None and not self._ordered(stream, last[0], last[1]):
            self.races.append(f"{op} on {stream} overwrites what {last[2]} on {last[0]} wrote, "
                              "without waiting for it")
        for other, (when, reader) in self.reads.get(key, {}).items():
            if not self._ordered(stream, other, when):
                self.races.append(f"{op} on {stream} overwrites what {reader} on {other} still "
                                  "reads, without waiting for it")
        self.writes[key] = (stream, time, op)
        self.reads[key] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if threading.current_thread() is not threading.main_thread():
            return out
        name = str(func)
        stream = self.current
        if func.namespace == "c10d" and self.issuing is not None:
            stream = self.issuing  # a collective: on a stream of its own, after the issuer's
            self.merge(stream, self.snapshot(self.current))
        time = self._tick(stream)
        written, read = _accesses(func, args, kwargs)
        fresh = {_key(t) for t in _tensors(out)} - {_key(t) for t in _tensors((args, kwargs))}
        for key in read:
            self._read(stream, key, time, name)
        for key in written:
            self._write(stream, key, time, name)
        for key in fresh - {None}:
            self.writes[key] = (stream, time, name)
            self.reads[key] = {}
        return out


def _tensors(tree) -> list[torch.Tensor]:
    from torch.utils._pytree import tree_leaves

    return [t for t in tree_leaves(tree) if isinstance(t, torch.Tensor)]


def _key(tensor: torch.Tensor) -> int | None:
    storage = tensor.untyped_storage()
    return storage.data_ptr() if storage.nbytes() else None


def _accesses(func, args, kwargs) -> tuple[set[int], set[int]]:
    """(storages written, storages read) by one operator."""
    written, read = set(), set()
    if func.namespace == "c10d":
        # The first argument is the output (in place for all_reduce / broadcast), except send.
        first = _tensors(args[0]) if args else []
        rest = _tensors((args[1:], kwargs))
        (read if "send" in str(func) else written).update(_key(t) for t in first)
        read.update(_key(t) for t in first + rest)
    else:
        schema = func._schema.arguments
        for position, arg in enumerate(schema):
            value = args[position] if position < len(args) else kwargs.get(arg.name)
            keys = {_key(t) for t in _tensors(value)}
            if arg.alias_info is not None and arg.alias_info.is_write:
                written |= keys
            read |= keys
    return written - {None}, read - {None}


class FakeStream:
    """A named side stream (its ordering lives in the checker)."""

    def __init__(self, name: str):
        self.name = name


class FakeEvent:
    """A snapshot of a stream's clock."""

    def __init__(self, checker: OrderChecker, stream: str):
        self.checker, self.stream = checker, stream
        self.covered = checker.snapshot(stream)

    def query(self) -> bool:
        """Never known to be done without waiting."""
        return False

    def synchronize(self) -> None:
        """The host waits for it."""
        self.checker.host_wait(self.covered)


def recording_streams(checker: OrderChecker):
    """A `Streams` class whose instances record into `checker` (active on CPU)."""
    from zeroshard.dist.streams import STEP_STREAMS, Streams

    class RecordingStreams(Streams):
        def __init__(self, device: torch.device, names: tuple[str, ...] = STEP_STREAMS):
            self.device = device
            self.active = True
            self.side = {name: FakeStream(name) for name in names}

        def record(self, stream=None):
            return FakeEvent(checker, stream.name if stream is not None else checker.current)

        def wait(self, event, stream=None) -> None:
            if event is not None:
                checker.merge(stream.name if stream is not None else checker.current,
                              event.covered)

        def keep_until_used(self, tensor: torch.Tensor) -> None:
            last = checker.writes.get(_key(tensor))
            checker.kept.append((last[0] if last is not None else None, checker.current))

        @contextlib.contextmanager
        def on(self, name: str):
            outer = checker.current
            checker.merge(name, checker.snapshot(outer))
            checker.current = name
            try:
                yield
            finally:
                checker.current = outer

    return RecordingStreams


@contextlib.contextmanager
def checked_streams(checker: OrderChecker):
    """Inside: engines built get recording streams, and collective handles order the stream that
    waits for them after the collective."""
    from zeroshard import build
    from zeroshard.dist import comm as comm_module

    originals = (build.Streams, comm_module.Comm._run, comm_module._Watched.wait,
                 comm_module._ExchangeReduceScatter.__init__,
                 comm_module._ExchangeReduceScatter.wait)
    run, watched_wait, exchange_init, exchange_wait = originals[1:]

    def issue(fn):
        def wrapper(self, *args, **kwargs):
            checker.begin_issue()
            try:
                fn(self, *args, **kwargs)
            finally:
                self._check_stream = checker.end_issue()
        return wrapper

    def waited(fn):
        def wrapper(self, *args, **kwargs):
            stream = getattr(self, "_check_stream", None)
            if stream is not None:
                checker.merge(checker.current, checker.snapshot(stream))
            return fn(self, *args, **kwargs)
        return wrapper

    def run_checked(self, kind, unit, issue_fn, async_op=False, then=None):
        checker.begin_issue()
        try:
            handle = run(self, kind, unit, issue_fn, True, then)
        finally:
            stream = checker.end_issue()
        handle._check_stream = stream
        return handle if async_op else handle.wait()

    build.Streams = recording_streams(checker)
    comm_module.Comm._run = run_checked
    comm_module._Watched.wait = waited(watched_wait)
    comm_module._ExchangeReduceScatter.__init__ = issue(exchange_init)
    comm_module._ExchangeReduceScatter.wait = waited(exchange_wait)
    try:
        with checker:
            yield checker
    finally:
        (build.Streams, comm_module.Comm._run, comm_module._Watched.wait,
         comm_module._ExchangeReduceScatter.__init__,
         comm_module._ExchangeReduceScatter.wait) = originals
