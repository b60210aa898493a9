"""The NVMe tier (ZeRO-Infinity): swap files, aligned staging buffers and asynchronous I/O.

Files live under `<nvme_path>/zeroshard/rank<r>/`, one per unit shard and kind
(`optimizer-u12-exp_avg.swp`, `param-u12.swp`). Each is preallocated to its final size when the
engine is built (so a full disk is found before the first step, not in the middle of one), sized
up to a multiple of 4 KiB, and removed when the engine is destroyed or the process exits.

I/O runs on a thread pool over `os.preadv` / `os.pwritev`, which release the GIL, so reads and
writes proceed while Python computes. A request is split into `aio.block_size` chunks, all
submitted at once; `thread_count x queue_depth` threads keep that many chunks in flight. Files are
opened with O_DIRECT when the filesystem accepts it (bypassing the page cache, as DeepSpeed's
libaio path does); staging buffers are then 4 KiB-aligned. Otherwise buffered I/O is used.
"""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
import threading
import weakref
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from ..dist.hostmem import byte_view, mark_host

#: Alignment of buffers, offsets and lengths for O_DIRECT (the largest common logical block).
BLOCK = 4096
#: Free space kept beyond the swap files themselves when checking nvme_path.
MARGIN_BYTES = 64 << 20
MARGIN_FRACTION = 0.02


class NvmeError(OSError):
    """An NVMe swap directory is unusable, too small, or a swap read/write failed."""

    def __str__(self) -> str:
        return str(self.strerror)


def round_up(nbytes: int) -> int:
    """`nbytes` rounded up to a multiple of BLOCK."""
    return -(-nbytes // BLOCK) * BLOCK


def aligned_buffer(nbytes: int, pin: bool = False) -> torch.Tensor:
    """A uint8 CPU tensor of round_up(nbytes) bytes starting on a BLOCK boundary."""
    size = round_up(nbytes)
    raw = mark_host(torch.empty(size + BLOCK, dtype=torch.uint8, device="cpu",
                                pin_memory=pin and torch.cuda.is_available()))
    start = (-raw.data_ptr()) % BLOCK
    return raw[start:start + size]


def _pread(fd: int, view: memoryview, offset: int) -> int:
    return os.preadv(fd, [view], offset)


def _pwrite(fd: int, view: memoryview, offset: int) -> int:
    return os.pwritev(fd, [view], offset)


def _human(nbytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if nbytes < 1024 or unit == "TiB":
            return f"{nbytes:.1f} {unit}" if unit != "B" else f"{int(nbytes)} B"
        nbytes /= 1024
    return f"{nbytes:.1f} TiB"


class SwapDir:
    """This rank's swap directory for one kind of state ("optimizer" or "param")."""

    def __init__(self, nvme_path: str, rank: int, label: str, config_key: str):
        self.label = label
        self.key = config_key
        self.root = os.path.join(os.path.abspath(nvme_path), "zeroshard", f"rank{rank}")
        self.files: dict[str, int] = {}  # name -> fd
        self.sizes: dict[str, int] = {}
        try:
            os.makedirs(self.root, exist_ok=True)
        except OSError as err:
            raise NvmeError(err.errno, f"{config_key}.nvme_path: cannot create {self.root} "
                            f"({err.strerror}); give a directory on a local disk that this "
                            "process may write") from None
        self._lock_fd = self._lock()
        self._remove_stale()
        self.direct = self._probe_direct()
        self._finalizer = weakref.finalize(self, _cleanup, self.root, label, self.files,
                                           self._lock_fd)

    def _lock(self) -> int:
        path = os.path.join(self.root, f".{self.label}.lock")
        try:
            fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o644)
        except OSError as err:
            raise NvmeError(err.errno, f"{self.key}.nvme_path: {self.root} is not writable "
                            f"({err.strerror})") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise NvmeError(errno.EBUSY, f"{self.key}.nvme_path: {self.root} is in use by another "
                            f"zeroshard process ({self.label} swap files); give each job its own "
                            "nvme_path") from None
        return fd

    def _remove_stale(self) -> None:
        """Delete swap files a killed run left behind (we hold the lock, so nobody uses them)."""
        for name in os.listdir(self.root):
            if name.startswith(self.label + "-") and name.endswith(".swp"):
                os.remove(os.path.join(self.root, name))

    def _probe_direct(self) -> bool:
        path = os.path.join(self.root, f".{self.label}.probe")
        buf = aligned_buffer(BLOCK)
        try:
            fd = os.open(path, os.O_CREAT | os.O_RDWR | getattr(os, "O_DIRECT", 0), 0o644)
        except OSError:
            fd = None
        try:
            if fd is not None and hasattr(os, "O_DIRECT"):
                try:
                    _pwrite(fd, byte_view(buf), 0)
                    return True
                except OSError:
                    pass
            try:
                with open(path, "wb") as fh:
                    fh.write(b"\0" * BLOCK)
            except OSError as err:
                raise NvmeError(err.errno, f"{self.key}.nvme_path: cannot write in {self.root} "
                                f"({err.strerror})") from None
            return False
        finally:
            if fd is not None:
                os.close(fd)
            if os.path.exists(path):
                os.remove(path)

    def require_space(self, needed: int) -> None:
        """Raise NvmeError naming the path and sizes unless `needed` bytes (plus margin) are free."""
        free = shutil.disk_usage(self.root).free
        want = needed + MARGIN_BYTES + int(needed * MARGIN_FRACTION)
        if free < want:
            raise NvmeError(errno.ENOSPC,
                            f"{self.key}.nvme_path: {self.root} needs {_human(want)} "
                            f"({want} bytes: {_human(needed)} of {self.label} swap files plus "
                            f"margin) but its filesystem has {_human(free)} ({free} bytes) free; "
                            "free space, point nvme_path at a larger disk, or use more ranks")

    def create(self, name: str, nbytes: int) -> None:
        """Create and preallocate swap file `name` of round_up(nbytes) bytes."""
        path = self.path(name)
        size = round_up(nbytes)
        flags = os.O_CREAT | os.O_RDWR | os.O_TRUNC | (os.O_DIRECT if self.direct else 0)
        fd = os.open(path, flags, 0o600)
        self.files[name] = fd
        self.sizes[name] = size
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as err:
            raise NvmeError(err.errno, f"{self.key}.nvme_path: cannot allocate {_human(size)} for "
                            f"{path} ({err.strerror})") from None

    def path(self, name: str) -> str:
        """Full path of swap file `name`."""
        return os.path.join(self.root, f"{self.label}-{name}.swp")

    def fd(self, name: str) -> int:
        """Open descriptor of swap file `name`."""
        return self.files[name]

    def nbytes(self) -> int:
        """Bytes of all swap files (the ledger's "nvme" figure)."""
        return sum(self.sizes.values())

    def mapped(self, name: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """The first `numel` elements of swap file `name` as a tensor mapped onto the file (writes
        reach the file; used for checkpoints, where the whole shard must be visible at once)."""
        return mark_host(torch.from_file(self.path(name), shared=True, size=numel, dtype=dtype))

    def sync(self) -> None:
        """Flush all swap files (after writes through `mapped` views)."""
        for fd in self.files.values():
            os.fsync(fd)

    def close(self) -> None:
        """Close and delete every swap file and release the lock."""
        self._finalizer()


def _cleanup(root: str, label: str, files: dict, lock_fd: int) -> None:
    for name, fd in list(files.items()):
        try:
            os.close(fd)
        except OSError:
            pass
        try:
            os.remove(os.path.join(root, f"{label}-{name}.swp"))
        except OSError:
            pass
    files.clear()
    try:
        os.remove(os.path.join(root, f".{label}.lock"))
        os.close(lock_fd)
    except OSError:
        pass
    for path in (root, os.path.dirname(root)):
        try:
            os.rmdir(path)  # only when empty: another kind's files may still be there
        except OSError:
            pass


class Request:
    """One read or write of a whole tensor, split into chunks in flight on the pool.

    `on_done` runs on the worker thread that finishes the last chunk (so a staging buffer goes
    back to its pool even while the main thread is blocked waiting for one); errors surface in
    `wait()`.
    """

    def __init__(self, what: str, futures: list[Future], on_done=None):
        self.what = what
        self.futures = futures
        self.finished = False
        self._left = len(futures)
        self._lock = threading.Lock()
        self._on_done = on_done
        if not futures and on_done is not None:
            on_done()
        for future in futures:
            future.add_done_callback(self._chunk_done)

    def _chunk_done(self, _future) -> None:
        with self._lock:
            self._left -= 1
            last = self._left == 0
        if last and self._on_done is not None:
            self._on_done()

    def done(self) -> bool:
        """Whether every chunk has completed (successfully or not)."""
        return all(f.done() for f in self.futures)

    def wait(self) -> None:
        """Block until complete; raise NvmeError naming the file if any chunk failed."""
        if self.finished:
            return
        self.finished = True
        error = None
        for future in self.futures:
            try:
                future.result()
            except OSError as err:
                error = error or err
        if error is not None:
            raise NvmeError(error.errno or errno.EIO,
                            f"NVMe swap {self.what} failed: {error.strerror or error}") from error


class AsyncIO:
    """Thread-pool asynchronous reads and writes of tensors to swap files."""

    def __init__(self, threads: int = 8, block_size: int = 1 << 20):
        self.block = max(BLOCK, round_up(block_size))
        self.pool = ThreadPoolExecutor(max_workers=max(1, threads),
                                       thread_name_prefix="zeroshard-aio")
        self.lock = threading.Lock()

    def _submit(self, op, fd: int, tensor: torch.Tensor, nbytes: int, what: str, on_done,
                before=None):
        view = byte_view(tensor.view(torch.uint8))
        futures = []
        for offset in range(0, nbytes, self.block):
            end = min(nbytes, offset + self.block)
            futures.append(self.pool.submit(_whole, op, fd, view[offset:end], offset, before))
        return Request(what, futures, on_done)

    def read(self, swap: SwapDir, name: str, tensor: torch.Tensor, on_done=None) -> Request:
        """Start reading swap file `name` into `tensor` (an aligned buffer of the file's size)."""
        nbytes = min(swap.sizes[name], tensor.numel() * tensor.element_size())
        return self._submit(_pread, swap.fd(name), tensor, nbytes, f"read of {swap.path(name)}",
                            on_done)

    def write(self, swap: SwapDir, name: str, tensor: torch.Tensor, on_done=None,
              before=None) -> Request:
        """Start writing `tensor` (an aligned buffer of the file's size) to swap file `name`;
        with `before` (a `torch.Event`: a device->host copy into `tensor`), the I/O threads wait
        for it first, so the host never does."""
        nbytes = min(swap.sizes[name], tensor.numel() * tensor.element_size())
        return self._submit(_pwrite, swap.fd(name), tensor, nbytes, f"write of {swap.path(name)}",
                            on_done, before)

    def after(self, event, fn) -> None:
        """Run `fn` on an I/O thread once `event` (a `torch.Event`, or None: now) is done."""
        if event is None:
            fn()
            return

        def wait_then():
            event.synchronize()
            fn()
        self.pool.submit(wait_then)

    def close(self) -> None:
        """Stop the worker threads (pending requests finish first)."""
        self.pool.shutdown(wait=True)


def _whole(op, fd: int, view: memoryview, offset: int, before=None) -> None:
    """Run a pread/pwrite until the whole chunk is transferred (short transfers are retried),
    after the event `before` if any (on this I/O thread)."""
    if before is not None:
        before.synchronize()
    done = 0
    while done < len(view):
        n = op(fd, view[done:], offset + done)
        if n <= 0:
            raise OSError(errno.EIO, "short transfer (end of file or device error)")
        done += n


class BufferPool:
    """A fixed set of aligned staging buffers of one size, handed out and returned."""

    def __init__(self, nbytes: int, count: int, pin: bool = False):
        self.nbytes = round_up(nbytes)
        self.free = [aligned_buffer(self.nbytes, pin) for _ in range(count)]
        self.count = count
        self.cond = threading.Condition()

    def take(self) -> torch.Tensor:
        """A free buffer (the caller must have made sure one is or will become free)."""
        with self.cond:
            while not self.free:
                self.cond.wait()
            return self.free.pop()

    def give(self, buffer: torch.Tensor) -> None:
        """Return a buffer to the pool."""
        with self.cond:
            self.free.append(buffer)
            self.cond.notify()

    def tensors(self) -> list[torch.Tensor]:
        """Free buffers (for the memory ledger; buffers in use are counted by their users)."""
        return list(self.free)
