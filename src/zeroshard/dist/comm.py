"""The one collective wrapper every zeroshard collective goes through (process-group start and
exit: `process_group.py`; host topology: `topology.py`; strict host mode: `hostpolicy.py`).

`Comm` counts, per rank, the bytes each collective moves under the ring model that the ZeRO paper
uses: all-gather and reduce-scatter move (N-1)/N of the full (gathered / unreduced) payload, an
all-reduce twice that. `comm_report()` returns the cumulative counts.

Intra-host and inter-host bytes. The ledger also splits every count by the link it crosses, with
this model: a collective over the n ranks of a group runs as a ring in group-rank order, each rank
sending to the next; each of the ring's n hops carries the same bytes, and a hop crosses hosts when
its two ranks are on different hosts. The crossing bytes are spread evenly over the ring's ranks:
the inter-host share of every rank's count is c/n, c being the number of crossing hops. Hosts come
from the node layout torchrun gives (`HostLayout.from_env`): global rank r is on host r // P,
P = LOCAL_WORLD_SIZE, every host running P consecutive ranks, as torchrun assigns them. For the
whole world of N = H x P ranks on H > 1 hosts, c = H and the inter-host share is H/N = 1/P; summed
over one host's P ranks, the inter-host bytes are exactly what that host's one outgoing ring hop
carries. One rank per host makes every byte inter-host; one host, none.

The split is a model, like the counts. gloo's all-reduce is such a ring, and on two simulated hosts
of two ranks its bytes over each host's link were within 0.3% of the model. The all-gather and
reduce-scatter that `Comm` composes on gloo (pairwise exchanges) cross hosts more often than a
ring: training there sent 1.5x the model's inter-host bytes at stages 1-2 and 1.58x at stage 3
(tests/test_multihost.py; measured with all-gathers made of broadcasts, which move the same bytes
between the same ranks as the exchanges that replaced them).

What a Comm is given, at construction and never changed after: the ledger it counts into
(`ledger.py`; shared by a world and its subgroups), the desync watchdog (`watchdog.py`) and the
step counter (`steps.py`). A `World` (`world.py`) makes the Comms of a run and hands each the
same three. Each collective takes a ticket from the watchdog (a local record, no communication)
and is waited through it: on gloo with a deadline, on device backends through a poller thread.
Without a watchdog (one rank, timeout 0) waits are plain.

Strict host mode (`ZEROSHARD_STRICT_HOST=1`, on for the whole test suite): every tensor zeroshard
places in host memory carries a mark on its storage (`hostmem.py` sets it), and a `Comm` on
the default group, which is NCCL on GPUs and takes device tensors only, refuses a marked tensor,
naming the call site. So on a CPU-only machine, where host and device are the same memory, a host
tensor reaching an NCCL collective is still an error. Side groups created for host traffic
(`Comm(group, host=True)`, explicitly gloo) accept them.
"""

from __future__ import annotations

import contextlib
import os
import pickle

import torch
import torch.distributed as dist

from .hostpolicy import HostMemoryError, call_site, is_host, strict_host  # noqa: F401
from .ledger import Ledger
from .process_group import leave_cleanly_at_exit
from .steps import StepCounter
from .topology import HostLayout, group_ranks

# torch >= 2.13 renamed the tensor collectives; older releases only have the *_tensor names.
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

# Kinds of point-to-point exchange, in bit 30 of their tags (Comm.next_tag).
_REDUCE_SCATTER_TAG, _ALL_GATHER_TAG = 0, 1

def default_device() -> torch.device:
    """`cuda:LOCAL_RANK` when CUDA is available, else CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def computes_in_fp16(device: torch.device) -> bool:
    """Whether `device` has fp16 kernels (DeepSpeed's rule: a GPU of compute capability 7.0 or
    newer, a CPU whose oneDNN has fp16 kernels); the accelerators' `is_fp16_supported`."""
    if device.type == "cuda":
        return torch.cuda.get_device_capability(device)[0] >= 7
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    except (AttributeError, RuntimeError):
        return False


def wait_all(handles) -> None:
    """Wait for every async collective handle (None entries are already complete)."""
    for handle in handles:
        if handle is not None:
            handle.wait()


def _host_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of `tensor` in (pageable) host memory, for a gloo collective."""
    return torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu").copy_(tensor)


class _Watched:
    """One collective's work objects, waited through the Comm (and its watchdog, if any)."""

    def __init__(self, comm: "Comm", works, ticket, then=None):
        self.comm, self.works, self.ticket, self.then = comm, works, ticket, then

    def wait(self) -> None:
        """Block until the collective has finished (then run its last local step, if any)."""
        if self.works:
            self.comm._wait(self.works, self.ticket)
            self.works = []  # drop gloo work objects now: one outliving its group aborts at exit
        if self.then is not None:
            then, self.then = self.then, None
            then()


class _ExchangeReduceScatter:
    """A reduce-scatter from point-to-point exchanges: send peers their slices, sum what arrives.

    `rows` is [K, N, S]: peer p's slice is `rows[:, p]`, K contiguous pieces sent as K messages
    (K = 1 for a plain reduce-scatter of a flat buffer)."""

    def __init__(self, comm: "Comm", rows: torch.Tensor, ticket, unit=None, then=None):
        self.comm, self.ticket, self.then = comm, ticket, then
        self.own = rows[:, comm.rank]
        tags = [comm.next_tag(unit, _REDUCE_SCATTER_TAG) for _ in range(rows.shape[0])]
        self.received, ops = [], []
        for peer in range(comm.world_size):
            if peer == comm.rank:
                continue
            incoming = torch.empty(self.own.shape, dtype=rows.dtype, device=rows.device)
            self.received.append(incoming)
            for k, tag in enumerate(tags):
                ops.append(dist.P2POp(dist.isend, rows[k, peer], comm._ranks[peer], comm.group,
                                      tag))
                ops.append(dist.P2POp(dist.irecv, incoming[k], comm._ranks[peer], comm.group,
                                      tag))
        self.requests = comm._post(ticket, lambda: dist.batch_isend_irecv(ops))
        comm._started(self.requests, ticket)

    def wait(self) -> None:
        """Wait for the exchanges and add what arrived into this rank's own slice."""
        if self.requests:
            self.comm._wait(self.requests, self.ticket)
        # Drop the gloo work objects now: one outliving its process group aborts at exit.
        self.requests = []
        for incoming in self.received:
            self.own.add_(incoming)
        self.received.clear()
        if self.then is not None:
            then, self.then = self.then, None
            then()


class Comm:
    """Collectives over one process group, each one counted in the comm ledger.

    On gloo the tensor all-gather and reduce-scatter are slow generic paths (measured on 2 CPU
    ranks: 3-8x an all-reduce of the same payload). So on gloo both are composed from direct
    exchanges. All-gather: each rank sends every peer its own slice (the same bytes as N
    broadcasts). Reduce-scatter: each rank sends every peer that peer's slice and sums the N-1
    slices it receives (at 16 M fp32 elements: 35 ms vs 45 ms for N reduces and 37 ms for a
    whole all-reduce at N=2; 75 / 90 / 112 ms at N=4). Their point-to-point tags name the unit
    (`next_tag`). The ledger counts the collective's ring-model bytes either way.

    gloo's transport reads and writes host memory only (given a CUDA tensor, torch 2.11's gloo
    failed with "writev: Bad address"). So a gloo group handed device tensors, e.g. two ranks
    sharing one GPU, where NCCL refuses, stages each collective through host copies
    (`_on_host`): correct, and as slow as such a set-up is anyway.
    """

    def __init__(self, group=None, host: bool = False, *, ledger: Ledger | None = None,
                 watch=None, steps: StepCounter | None = None):
        leave_cleanly_at_exit()  # also when the user, not zeroshard, started the process group
        self.group = group
        #: Strict host mode and this group is not a host (gloo) side group: refuse host tensors.
        self.strict = strict_host() and not host
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        #: Where this group's bytes are counted (a World's one ledger, or a ledger of its own).
        self.ledger = ledger if ledger is not None else Ledger()
        self.composed = dist.get_backend(group) == "gloo"
        self._ranks = group_ranks(group)
        self.layout = HostLayout.from_env(dist.get_world_size())
        self.crossing_share = self.layout.crossing_share(self._ranks)
        self._tag = 0
        #: The desync watchdog (`watchdog.py`; None: collectives wait plainly).
        self.watch = watch
        #: The step counter the engine phases are counted in (`phase`).
        self.steps = steps if steps is not None else StepCounter()

    @property
    def bytes(self):
        """Bytes moved per collective kind (the ledger's, shared with the ledger's other groups)."""
        return self.ledger.bytes

    @property
    def inter_host_bytes(self):
        """The inter-host part of `bytes`, per kind."""
        return self.ledger.inter_host_bytes

    # -- the watchdog's hooks: a local record per collective, a deadline on each wait -----------
    def _ticket(self, kind: str, unit):
        return None if self.watch is None else self.watch.issued(kind, unit)

    def _post(self, ticket, issue) -> list:
        """Post one collective (`issue()` returns its work objects). A peer that is already gone
        can fail it here, before any wait (gloo: "Connection closed by peer"): under the
        watchdog that failure is diagnosed like a failed wait (a DesyncError naming the peer)."""
        try:
            return [w for w in issue() if w is not None]
        except RuntimeError as err:
            if ticket is None:
                raise
            self.watch.failed(ticket, err)  # raises the DesyncError

    def _started(self, works, ticket) -> None:
        if ticket is not None:
            self.watch.started(works, ticket)

    def _wait(self, works, ticket) -> None:
        if ticket is None:
            for work in works:
                work.wait()
        else:
            self.watch.wait(works, ticket)

    def _run(self, kind: str, unit, issue, async_op: bool = False, then=None):
        """Issue one collective (`issue()` returns its work objects); wait unless `async_op`.
        `then`: a last local step, run once the collective has finished."""
        ticket = self._ticket(kind, unit)
        works = self._post(ticket, issue)
        self._started(works, ticket)
        handle = _Watched(self, works, ticket, then)
        return handle if async_op else handle.wait()

    def _on_host(self, *tensors: torch.Tensor) -> bool:
        """Whether this collective must run on host copies: a gloo group, device tensors."""
        return self.composed and any(t.device.type != "cpu" for t in tensors)

    @contextlib.contextmanager
    def phase(self, name: str):
        """Count the engine phase `name` in the step counter (backward passes and optimizer steps
        are compared across ranks) and label the collectives issued inside in desync reports."""
        self.steps.enter(name)
        if self.watch is None:
            yield
            return
        with self.watch.in_phase(name):
            yield

    def next_tag(self, unit=None, kind: int = 0) -> int:
        """A point-to-point message tag that every rank draws in the same order.

        It packs a running count (keeps two in-flight exchanges between the same pair of ranks
        apart), the unit's index and the kind of exchange. When ranks disagree on the next
        collective, their messages then carry different tags and never pair up: they wait (and
        the desync watchdog reports it) instead of exchanging the wrong unit's bytes, or
        aborting the process inside gloo when the sizes differ.

        The tag does not depend on the step counts: a rank that skipped `engine.step()` (or ran
        an extra backward) issues the same collectives as its peers, one step apart, and they
        pair up, so that the step counts riding in the step's gradient-norm all-reduce
        (`core/step_check.py`) meet and are compared there, raising DesyncError at the next
        step instead of a watchdog timeout.
        """
        self._tag = (self._tag + 1) % (1 << 18)
        return (kind << 30) | (self._tag << 12) | (getattr(unit, "index", 4095) % 4096)

    def _refuse_host(self, kind: str, *tensors: torch.Tensor) -> None:
        """Strict host mode: raise HostMemoryError if a tensor lives in host memory."""
        if any(is_host(t) for t in tensors):
            raise HostMemoryError(
                f"strict host mode: {kind} at {call_site(('comm.py',))} got a tensor in host memory "
                "(offloaded state, a CPU gradient shard, a staging buffer, or a model built on the "
                "CPU) on the default process group, which is NCCL on GPUs and takes compute-device "
                "tensors only. Copy it to the compute device first (dist/hostmem.py to_device), or "
                "use a gloo side group made for host traffic (Comm(group, host=True)).")

    def _count(self, kind: str, payload_bytes: int, factor: float) -> None:
        n = self.world_size
        moved = int(round(factor * payload_bytes * (n - 1) / n))
        self.ledger.add(kind, moved, int(round(moved * self.crossing_share)))

    def all_reduce(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM, async_op: bool = False,
                   unit=None, checked: int = 0):
        """Sum (or `op`) `tensor` in place across ranks (`unit`: named in desync reports). Its
        last `checked` elements are the ranks' step counts (`core/step_check.py`): counted in
        the ledger as "step_check", apart from the payload."""
        if self.strict:
            self._refuse_host("all_reduce", tensor)
        self._count("all_reduce", (tensor.numel() - checked) * tensor.element_size(), 2.0)
        if checked:
            self._count("step_check", checked * tensor.element_size(), 2.0)
        if self.world_size == 1:
            return None
        if self._on_host(tensor):
            host = _host_copy(tensor)
            return self._run("all-reduce", unit, lambda: [
                dist.all_reduce(host, op=op, group=self.group, async_op=True)], async_op,
                then=lambda: tensor.copy_(host))
        return self._run("all-reduce", unit, lambda: [
            dist.all_reduce(tensor, op=op, group=self.group, async_op=True)], async_op)

    def all_gather(self, output: torch.Tensor, shard: torch.Tensor, async_op: bool = False,
                   unit=None):
        """Gather every rank's `shard` into `output` (rank order); `shard` may alias its own slot."""
        if self.strict:
            self._refuse_host("all_gather", output, shard)
        self._count("all_gather", output.numel() * output.element_size(), 1.0)
        if self.world_size == 1:
            if shard.data_ptr() != output.data_ptr():
                output.copy_(shard)
            return None
        if self._on_host(output, shard):
            host_out = torch.empty(output.shape, dtype=output.dtype, device="cpu")
            host_shard = _host_copy(shard)  # before anything writes `output`: `shard` may alias it
            return self._run("all-gather", unit,
                             lambda: self._issue_all_gather(host_out, host_shard, unit), async_op,
                             then=lambda: output.copy_(host_out))
        return self._run("all-gather", unit,
                         lambda: self._issue_all_gather(output, shard, unit), async_op)

    def _issue_all_gather(self, output: torch.Tensor, shard: torch.Tensor, unit=None) -> list:
        if not self.composed:
            return [_ALL_GATHER(output, shard, group=self.group, async_op=True)]
        slots = output.chunk(self.world_size)
        own = slots[self.rank]
        if shard.data_ptr() != own.data_ptr():
            own.copy_(shard)
        tag = self.next_tag(unit, _ALL_GATHER_TAG)
        ops = []
        for peer in range(self.world_size):
            if peer != self.rank:
                ops.append(dist.P2POp(dist.isend, own, self._ranks[peer], self.group, tag))
                ops.append(dist.P2POp(dist.irecv, slots[peer], self._ranks[peer], self.group, tag))
        return dist.batch_isend_irecv(ops)

    def reduce_scatter(self, full: torch.Tensor, async_op: bool = False, unit=None):
        """Sum `full` across ranks into this rank's own contiguous 1/N slice of `full`, in place.

        The rest of `full` is left unspecified. Reducing in place spares a shard-sized output
        buffer per collective in flight. `unit` is named in desync reports.
        """
        return self.reduce_scatter_rows(full.view(1, self.world_size, -1), async_op, unit)

    def reduce_scatter_rows(self, rows: torch.Tensor, async_op: bool = False, unit=None):
        """Sum `rows` ([K, N, S], N = this group's size) across ranks into `rows[:, rank]`, in
        place: a reduce-scatter whose slices are K pieces apart (qgZ's host step reduces a
        unit's slots (h, l) for every host h at local rank l without a copy to regroup them).
        The rest of `rows` is left unspecified."""
        if self.strict:
            self._refuse_host("reduce_scatter", rows)
        self._count("reduce_scatter", rows.numel() * rows.element_size(), 1.0)
        if self.world_size == 1:
            return None
        own = rows[:, self.rank]
        ticket = self._ticket("reduce-scatter", unit)
        if not self.composed:
            # Native: regroup so that each rank's K pieces are contiguous (a copy when K > 1).
            full = rows.transpose(0, 1).reshape(-1)
            out = torch.empty(own.shape, dtype=rows.dtype, device=rows.device)
            works = self._post(ticket, lambda: [
                _REDUCE_SCATTER(out.view(-1), full, group=self.group, async_op=True)])
            self._started(works, ticket)
            # The last step of a native reduce-scatter: copy the received slice into place.
            handle = _Watched(self, works, ticket, then=lambda: own.copy_(out))
        elif self._on_host(rows):
            host = _host_copy(rows)
            handle = _ExchangeReduceScatter(self, host, ticket, unit,
                                            then=lambda: own.copy_(host[:, self.rank]))
        else:
            handle = _ExchangeReduceScatter(self, rows, ticket, unit)
        return handle if async_op else handle.wait()

    def broadcast(self, tensor: torch.Tensor, src: int, unit=None):
        """Copy `tensor` from rank `src` (of this group) to every rank."""
        if self.strict:
            self._refuse_host("broadcast", tensor)
        self._count("broadcast", tensor.numel() * tensor.element_size(), 1.0)
        if self.world_size == 1:
            return
        staged = self._on_host(tensor)
        target = _host_copy(tensor) if staged else tensor
        self._run("broadcast", unit, lambda: [
            dist.broadcast(target, src=self._ranks[src], group=self.group, async_op=True)],
            then=(lambda: tensor.copy_(target)) if staged else None)

    def all_to_all(self, received: torch.Tensor, send: torch.Tensor, received_splits: list[int],
                   send_splits: list[int], async_op: bool = False, unit=None):
        """Send `send_splits[r]` consecutive elements of `send` to rank r and receive
        `received_splits[q]` from rank q into `received`, in rank order (`async_op`: return a
        handle to wait on; `send` must stay untouched until then). Counted as the bytes sent to
        the other ranks; the inter-host share is exactly what goes to other hosts."""
        if self.strict:
            self._refuse_host("all_to_all", received, send)
        sent = sum(n for r, n in enumerate(send_splits) if r != self.rank)
        me = self.layout.host(self._ranks[self.rank])  # point to point: the split is exact
        crossing = sum(n for r, n in enumerate(send_splits)
                       if self.layout.host(self._ranks[r]) != me)
        self.ledger.add("all_to_all", sent * send.element_size(), crossing * send.element_size())
        if self.world_size == 1:
            received.copy_(send)
            return None
        staged = self._on_host(received, send)
        into = torch.empty(received.shape, dtype=received.dtype, device="cpu") if staged \
            else received
        source = _host_copy(send) if staged else send
        return self._run("all-to-all", unit, lambda: [dist.all_to_all_single(
            into, source, received_splits, send_splits, group=self.group, async_op=True)],
            async_op, then=(lambda: received.copy_(into)) if staged else None)

    def barrier(self) -> None:
        """Wait for every rank."""
        if self.world_size > 1:
            self._run("barrier", None, lambda: [dist.barrier(group=self.group, async_op=True)])

    def report(self) -> dict[str, int]:
        """Cumulative bytes moved by this rank per collective kind, "total", and its host split
        ("intra_host" + "inter_host" = "total", by the ring model of the module docstring): the
        ledger's, so a subgroup's bytes are in its world's report."""
        return self.ledger.report()

    def reset(self) -> None:
        """Zero the ledger (e.g. to measure one step)."""
        self.ledger.reset()

    def all_gather_object(self, obj) -> list:
        """Every rank's picklable `obj`, in rank order (small control messages; not in the ledger)."""
        if self.world_size == 1:
            return [obj]
        if self.watch is None:
            out = [None] * self.world_size
            dist.all_gather_object(out, obj, group=self.group)
            return out
        # Watched: torch's version waits inside, out of the watchdog's reach. Same two
        # collectives (sizes, then the padded bytes), each waited with a deadline.
        device = torch.device("cpu") if self.composed else \
            torch.device("cuda", torch.cuda.current_device())
        mine = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(device)
        sizes = torch.zeros(self.world_size, dtype=torch.int64, device=device)
        self._run("all-gather of objects", None, lambda: self._issue_all_gather(
            sizes, torch.tensor([mine.numel()], dtype=torch.int64, device=device)))
        sizes = sizes.tolist()
        padded = torch.zeros(max(sizes) * self.world_size, dtype=torch.uint8, device=device)
        own = torch.zeros(max(sizes), dtype=torch.uint8, device=device)
        own[:mine.numel()] = mine
        self._run("all-gather of objects", None, lambda: self._issue_all_gather(padded, own))
        rows = padded.cpu().view(self.world_size, -1)
        return [pickle.loads(rows[r, :n].numpy().tobytes()) for r, n in enumerate(sizes)]
