"""The checkpoint directory as one job's property, and a save's file operations made all or nothing.

- Ownership: the first save into `save_dir` takes an exclusive `flock` on the directory itself
  (rank 0; no lock file, so the directory lists only checkpoints) and keeps it until the process
  ends, which frees it even on SIGKILL. A second job's save into the same directory is refused
  with a `CheckpointError` naming the process that holds it (pid and command, found in
  `/proc/locks` on the same host). Where the filesystem has no `flock` (some network mounts), the
  save goes on unlocked. The open descriptor keeps the filesystem busy: `release_directory`
  gives it up (before an unmount, or to hand the directory to another job).
- Names: a save writes into `.<tag>.<host>.<pid>.partial`, keeps a replaced same-tag checkpoint as
  `.<tag>.<host>.<pid>.old` until the new one is in place, and writes `latest` through
  `.latest.<host>.<pid>.tmp`: no two writers share a temporary name.
- Stale leftovers: under the lock, every `.*.partial` / `.*.old` directory and `.latest.*.tmp`
  file is a leftover of a save that died (no other zeroshard job can be writing there) and is
  removed before the next save. Without the lock only this host's leftovers of dead processes are.
- Failures: an OSError becomes one line naming the file and the cause; ENOSPC also says the disk
  is full, how many bytes are free there and about how many the save needed.
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
import shutil
import socket

#: save_dir (real path) -> the open descriptor holding its lock, for the life of the process.
_HELD: dict[str, int] = {}
_LEFTOVER = re.compile(r"^\.(?P<tag>.+?)(?:\.(?P<host>[^.]+)\.(?P<pid>\d+))?\.(?:partial|old)$")
_LATEST_TMP = re.compile(r"^\.latest(?:\.(?P<host>[^.]+)\.(?P<pid>\d+))?\.tmp$")


def writer_id() -> str:
    """`<host>.<pid>` of this process, as used in temporary names (dots in the host name go)."""
    return f"{socket.gethostname().split('.')[0] or 'host'}.{os.getpid()}"


def partial_name(tag: str, writer: str) -> str:
    """The directory a save of `tag` by `writer` is written into before it is renamed."""
    return f".{tag}.{writer}.partial"


def own_directory(save_dir: str) -> str | None:
    """Make `save_dir`, lock it for this process (kept until exit); an error text or None."""
    try:
        os.makedirs(save_dir, exist_ok=True)
    except OSError as err:
        return describe_os_error(save_dir, err, "create the checkpoint directory")
    real = os.path.realpath(save_dir)
    for path in [p for p in _HELD if not os.path.isdir(p)]:  # removed since (e.g. rotated away)
        os.close(_HELD.pop(path))
    if real in _HELD:
        return None
    fd = os.open(real, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as err:
        os.close(fd)
        if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return (f"checkpoint directory {save_dir} belongs to another job: "
                    f"{_lock_holder(real)} holds its lock. Two jobs saving into one directory "
                    "would overwrite each other's checkpoints and 'latest'; give this job another "
                    "save_dir, or stop the other job first")
        return None  # no flock on this filesystem: save unlocked
    _HELD[real] = fd
    return None


def release_directory(save_dir: str) -> bool:
    """Give up this process's lock on `save_dir` (e.g. before an unmount); whether it had one."""
    fd = _HELD.pop(os.path.realpath(save_dir), None)
    if fd is not None:
        os.close(fd)
    return fd is not None


def holds_lock(save_dir: str) -> bool:
    """Whether this process holds `save_dir`'s lock."""
    return os.path.realpath(save_dir) in _HELD


def _lock_holder(real: str) -> str:
    """`process 1234 (python train.py ...) on this host`, from /proc/locks, or a vaguer phrase."""
    try:
        st = os.stat(real)
        inode = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
        with open("/proc/locks") as fh:
            for line in fh:
                fields = line.split()
                if "FLOCK" in fields and inode in fields:
                    pid = fields[fields.index(inode) - 1]
                    try:
                        with open(f"/proc/{pid}/cmdline", "rb") as cmd:
                            what = cmd.read().replace(b"\0", b" ").decode(errors="replace").strip()
                    except OSError:
                        what = "?"
                    return f"process {pid} ({what[:200]}) on this host ({socket.gethostname()})"
    except OSError:
        pass
    return "a process on another host (or out of sight of /proc/locks)"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_leftovers(save_dir: str) -> list[str]:
    """Remove what saves that died left in `save_dir` (see the module docstring); their names."""
    locked = holds_lock(save_dir)
    host, removed = writer_id().split(".")[0], []
    try:
        names = os.listdir(save_dir)
    except OSError:
        return removed
    for name in names:
        match = _LEFTOVER.match(name) or _LATEST_TMP.match(name)
        if match is None:
            continue
        mine = match.group("host") == host and match.group("pid") is not None and \
            int(match.group("pid")) != os.getpid() and not _alive(int(match.group("pid")))
        if not (locked or mine):
            continue
        path = os.path.join(save_dir, name)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            try:
                os.remove(path)
            except OSError:
                continue
        removed.append(name)
    return removed


def free_bytes(path: str) -> int | None:
    """Bytes an unprivileged writer can still use on the filesystem holding `path`."""
    while path and not os.path.exists(path):
        path = os.path.dirname(path)
    try:
        st = os.statvfs(path or ".")
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def describe_os_error(path: str, err: BaseException, doing: str = "write",
                      needed: int | None = None) -> str:
    """`could not write <path>: No space left on device (disk full: ...)`, one line."""
    cause = getattr(err, "strerror", None) or str(err).strip().splitlines()[0][:300] or \
        type(err).__name__
    text = f"could not {doing} {path}: {cause}"
    if getattr(err, "errno", None) == errno.ENOSPC:
        free = free_bytes(os.path.dirname(path) or path)
        text += " (disk full: " + (f"{free} bytes free there" if free is not None else
                                   "no space left")
        text += f", this rank's part of the save needs about {needed} bytes)" if needed else ")"
    elif getattr(err, "errno", None) == errno.EDQUOT:
        text += " (disk quota exceeded)"
    return text


def write_file(path: str, data: bytes) -> None:
    """Write `data` to `path` and fsync it (an OSError says why, with errno)."""
    with open(path, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())


def find_os_error(err: BaseException) -> OSError | None:
    """The OSError behind `err` (itself, or in its cause/context chain), if any."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, OSError):
            return err
        err = err.__cause__ or err.__context__
    return None


def describe_failure(path: str, err: BaseException, doing: str,
                     needed: int | None = None) -> str:
    """One line for a failed step: the path, the OS cause (disk full: free and needed bytes)."""
    os_err = find_os_error(err)
    if os_err is None and "unexpected pos" in str(err):
        os_err = OSError(errno.EIO, "short write (the disk may be full)")
    if os_err is not None:
        if os_err.filename:  # the very file (DCP's data files are named by their writer)
            path, doing = os.fspath(os_err.filename), doing.replace(" the data of", "")
        return describe_os_error(path, os_err, doing, needed)
    return f"could not {doing} {path}: {type(err).__name__}: {_first_line(err)}"


def _first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0][:300]
