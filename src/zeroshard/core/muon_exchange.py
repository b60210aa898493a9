"""Muon on zeroshard's shards: each matrix is orthogonalised whole, by one rank, its *owner*.

Newton-Schulz needs whole matrices, while rank r holds only the elements `[r*S, (r+1)*S)` of
each unit, so a matrix's averaged gradient is cut in pieces over consecutive ranks. Instead of
gathering every matrix on every rank, the matrices are dealt out: each Muon matrix gets one owner,
chosen at construction on every rank alike (largest first to the least loaded rank, balanced by
numel; ties to the rank that already holds most of it, then the lowest), and only the owner keeps
that matrix's momentum, whole (fp32, on the compute device; in host memory under optimizer
offload, copied to the device for its step and back). Adam parameters are not involved.

Communication plan, per optimizer step, after the stage averaged the gradients (the stage's own
plan is unchanged) and before the global gradient norm:
  1. collect: one all-to-all; each rank sends every owner the pieces of that owner's matrices
     it holds (in the gradients' dtype). A piece already on its owner does not move.
  2. compute, on each owner, per matrix: momentum, Nesterov blend and Newton-Schulz
     (`muon.muon_update`); the new momentum is staged, not yet written.
  3. return: one all-to-all, the inverse of 1: every holder of a piece gets the orthogonalised
     update of that piece back, and it takes the gradient's place in the unit's gradient shard
     (times the fp16 loss scale, which Newton-Schulz removed and the unscaling divides out again).
  4. the usual step: one global norm over Muon updates and Adam gradients (DeepSpeed's order: the
     clip covers the orthogonalised update), clipping, and the optimizer applies lr and weight
     decay to the fp32 master shards elementwise. The staged momentum is committed only if the
     step is applied (an fp16 overflow leaves it untouched).
Bytes per rank and step (ledger kind "all_to_all"): the pieces this rank holds of other ranks'
matrices (sent in 1) plus the pieces other ranks hold of its own (sent in 3). Each element of a
Muon matrix crosses at most once each way, so summed over ranks it is at most 2 x Psi_muon
elements, about 2 x Psi_muon x (N-1)/N if owners were drawn blindly (2 x Psi_muon x (N-1)/N^2
per rank), less where a matrix's owner holds most of it. Measured, 8 matrices of 256 x 256 at
stage 2 (fp32): 0.26 MB per rank and step at N=2, 0.09-0.17 MB at N=3, 0.26-0.79 MB at N=4,
beside the stage's own 3.2 / 4.2 / 4.7 MB (2 Psi (N-1)/N).
Memory beyond the momentum is transient, within the step: the two all-to-all buffers and the
update shards, each at most this rank's share of the Muon matrices, and one matrix's gradient,
momentum and Newton-Schulz temporaries at a time. Nothing of it overlaps backward (it needs the
averaged gradient, complete only at the accumulation boundary).
Stage 0 (and a world of one) holds every gradient whole: each rank runs Muon on every matrix with
its own replica of the momentum (stage 0's optimizer state is replicated anyway); nothing moves.

Checkpoints: the momentum of a matrix is one fragment covering the whole parameter,
`optim.momentum_buffer.<name>`, written by the matrix's owner; a load reads it whole on the new
owner, so checkpoints move between world sizes and stages like the rest of the state.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..dist import Comm
from ..dist.hostmem import host_copy, host_zeros, is_host, to_device
from .keys import optim_key
from .layout import Slot, Unit
from .muon import muon_update, ns_dtype

MOMENTUM_KEY = "momentum_buffer"


@dataclass
class Matrix:
    """One Muon parameter: where it lies in its unit, who holds which piece, who owns it."""

    index: int
    unit: Unit
    slot: Slot
    #: (rank, start, end) in the unit's flat coordinates, one per rank holding a piece.
    pieces: list[tuple[int, int, int]]
    owner: int = -1

    @property
    def name(self) -> str:
        """The parameter's name."""
        return self.slot.name


def assign_owners(matrices: list[Matrix], world_size: int) -> None:
    """Deal the matrices out to ranks, balanced by numel (module docstring); the same on every
    rank and at every stage (the shard geometry breaks ties, also at stage 0)."""
    load = [0] * world_size
    for m in sorted(matrices, key=lambda m: (-m.slot.numel, m.index)):
        lo, hi = m.slot.offset, m.slot.offset + m.slot.numel
        bounds = [m.unit.shard_bounds(r) for r in range(world_size)]
        held = {r: min(e, hi) - max(s, lo) for r, (s, e) in enumerate(bounds)}
        least = min(load)
        m.owner = min((r for r in range(world_size) if load[r] == least),
                      key=lambda r: (-held.get(r, 0), r))
        load[m.owner] += m.slot.numel


class MuonExchange:
    """Replaces the Muon units' gradient shards by their orthogonalised updates (see above)."""

    def __init__(self, units: list[Unit], comm: Comm, optimizer, *, sharded: bool,
                 momentum_dtype: torch.dtype = torch.float32, on_host: bool = False):
        """Plan the exchange for the units of `optimizer`'s Muon groups; `sharded`: rank r holds
        only its shard of each unit (stages 1-3), else every unit whole (stage 0); `on_host`:
        keep the momentum in host memory (optimizer offload; it visits the device to step)."""
        self.comm = comm
        #: Where the momentum lives, for the memory ledger: "device", or "cpu" under offload.
        self.place = "cpu" if on_host else "device"
        self.rank, self.world = comm.rank, comm.world_size
        self.optimizer = optimizer
        self.sharded = sharded and comm.world_size > 1
        self.momentum_dtype = momentum_dtype
        self.position = {u.index: i for i, u in enumerate(units)}
        self.matrices: list[Matrix] = []
        for unit in units:
            if not optimizer.param_groups[unit.group_index]["use_muon"]:
                continue
            for slot in unit.slots:
                if len(slot.shape) < 2:
                    raise ValueError(
                        f"Muon: parameter {slot.name} has shape {tuple(slot.shape)}; Muon "
                        "orthogonalises matrices only. Put it in a param group with "
                        "use_muon=False (Adam)")
                self.matrices.append(Matrix(len(self.matrices), unit, slot,
                                            self._pieces(unit, slot)))
        assign_owners(self.matrices, comm.world_size)
        #: The matrices whose momentum this rank keeps (all of them at stage 0).
        self.mine = [m for m in self.matrices if self.holds(m)]
        self.units = sorted({m.unit.index for m in self.matrices})
        # Phase 1 sends, per owner, the pieces this rank holds; phase 3 the inverse.
        self.outgoing = [[(m, s, e) for m in self.matrices for r, s, e in m.pieces
                          if r == self.rank and m.owner == o] if o != self.rank else []
                         for o in range(self.world)]
        self.incoming = [[(m, s, e) for m in self.mine for r, s, e in m.pieces if r == q]
                         if q != self.rank else [] for q in range(self.world)]
        #: Elements sent to / received from each rank in phase 1 (phase 3: the other way).
        self.sent = [sum(e - s for _, s, e in pieces) for pieces in self.outgoing]
        self.got = [sum(e - s for _, s, e in pieces) for pieces in self.incoming]
        #: (matrix index, holder) -> offset of that piece in the phase-1 receive buffer.
        self.where = {}
        at = 0
        for peer, pieces in enumerate(self.incoming):
            for m, s, e in pieces:
                self.where[(m.index, peer)] = at
                at += e - s
        self.momentum: dict[int, torch.Tensor] = {}
        self.staged: dict[int, torch.Tensor] = {}
        #: Whether a step was applied (or a checkpoint with momentum loaded): same on all ranks.
        self.started = False

    def _pieces(self, unit: Unit, slot: Slot) -> list[tuple[int, int, int]]:
        lo, hi = slot.offset, slot.offset + slot.numel
        if not self.sharded:
            return [(self.rank, lo, hi)]
        out = []
        for r in range(self.world):
            s, e = unit.shard_bounds(r)
            if max(s, lo) < min(e, hi):
                out.append((r, max(s, lo), min(e, hi)))
        return out

    def holds(self, m: Matrix) -> bool:
        """Whether this rank keeps `m`'s momentum (its owner; every rank at stage 0)."""
        return m.owner == self.rank or not self.sharded

    def _base(self, unit: Unit) -> int:
        """Where this rank's gradient slice of `unit` starts in the unit's flat coordinates."""
        return unit.shard_bounds(self.rank)[0] if self.sharded else 0

    # -- the step --------------------------------------------------------------------------------
    @torch.no_grad()
    def orthogonalize(self, grads: list[torch.Tensor], scale: float = 1.0) -> list[torch.Tensor]:
        """`grads` (one per unit, as the policy's `grad_shard`) with each Muon unit's slice
        replaced by the orthogonalised update (times `scale`); the new momentum is staged."""
        if not self.matrices:
            return grads
        grads = list(grads)
        device = self._device()
        for u in self.units:  # offloaded stages 2-3 hold gradient shards in host memory
            if is_host(grads[self.position[u]]):
                grads[self.position[u]] = to_device(grads[self.position[u]], device)
        dtype = grads[self.position[self.units[0]]].dtype

        def piece(unit: Unit, s: int, e: int) -> torch.Tensor:
            base = self._base(unit)
            return grads[self.position[unit.index]][s - base:e - base]

        # 1. collect
        flat = [piece(m.unit, s, e) for pieces in self.outgoing for m, s, e in pieces]
        send = torch.cat(flat).to(dtype) if flat else torch.empty(0, dtype=dtype, device=device)
        received = torch.empty(sum(self.got), dtype=dtype, device=device)
        if self.sharded:
            self.comm.all_to_all(received, send, self.got, self.sent)
        where = self.where
        # 2. compute; the updates of other ranks' pieces go into `back`, laid out as `received`
        updates = {u: torch.zeros_like(grads[self.position[u]]) for u in self.units}
        back = torch.empty_like(received)
        for m in self.mine:
            full = torch.empty(m.slot.numel, dtype=dtype, device=device)
            for r, s, e in m.pieces:
                at = slice(s - m.slot.offset, e - m.slot.offset)
                full[at] = piece(m.unit, s, e) if r == self.rank else \
                    received[where[(m.index, r)]:where[(m.index, r)] + e - s]
            update, self.staged[m.index] = self._update(m, full.view(m.slot.shape))
            update = update.reshape(-1)
            if scale != 1.0:
                update = update * scale
            for r, s, e in m.pieces:
                values = update[s - m.slot.offset:e - m.slot.offset]
                if r == self.rank:
                    base = self._base(m.unit)
                    updates[m.unit.index][s - base:e - base] = values
                else:
                    back[where[(m.index, r)]:where[(m.index, r)] + e - s] = values
        del received  # the gradients of this rank's matrices: done with
        # 3. return
        if self.sharded:
            returned = torch.empty_like(send)
            self.comm.all_to_all(returned, back, self.sent, self.got)
            at = 0
            for pieces in self.outgoing:
                for m, s, e in pieces:
                    base = self._base(m.unit)
                    updates[m.unit.index][s - base:e - base] = returned[at:at + e - s]
                    at += e - s
        for u, update in updates.items():
            grads[self.position[u]] = update
        return grads

    def _update(self, m: Matrix, grad: torch.Tensor):
        group = self.optimizer.param_groups[m.unit.group_index]
        momentum = self.momentum.get(m.index)
        if momentum is None:
            momentum = torch.zeros(m.slot.shape, dtype=self.momentum_dtype, device=grad.device)
        elif is_host(momentum):
            momentum = to_device(momentum, grad.device)
        method = group["ns_method"]
        update, momentum = muon_update(grad, momentum, group["momentum"], method,
                                       ns_dtype(method, grad.device, self.optimizer.ns_dtype))
        return update, host_copy(momentum) if self.place == "cpu" else momentum

    def commit(self) -> None:
        """The step was applied: the staged momentum becomes the momentum."""
        self.momentum.update(self.staged)
        self.staged.clear()
        self.started = self.started or bool(self.matrices)

    def discard(self) -> None:
        """The step was skipped: forget the staged momentum."""
        self.staged.clear()

    # -- ledger and checkpoints --------------------------------------------------------------------
    def tensors(self) -> list[torch.Tensor]:
        """The momentum buffers this rank holds (for the memory ledger)."""
        return [*self.momentum.values(), *self.staged.values()]

    def entries(self, fragments) -> dict[str, torch.Tensor]:
        """To save: `optim.momentum_buffer.<name>` of every matrix, this rank's piece being the
        whole momentum where it owns the matrix (`fragments(numel, pieces, dtype, device)`)."""
        if not self.started:
            return {}
        out = {}
        for m in self.matrices:
            buf = self.momentum.get(m.index) if m.owner == self.rank else None
            pieces = [(0, buf.reshape(-1))] if buf is not None else []
            out[optim_key(MOMENTUM_KEY, m.name)] = fragments(
                m.slot.numel, pieces, self.momentum_dtype, self._where())
        return out

    def targets(self, fragments) -> tuple[dict[str, torch.Tensor], dict[int, torch.Tensor]]:
        """To load: the DCP read targets (whole matrices this rank keeps) and the buffers behind
        them, by matrix index (`install` takes them)."""
        entries, buffers = {}, {}
        for m in self.matrices:
            pieces = []
            if self.holds(m):
                buffers[m.index] = host_zeros(m.slot.shape, self.momentum_dtype) \
                    if self.place == "cpu" else torch.zeros(
                        m.slot.shape, dtype=self.momentum_dtype, device=self._device())
                pieces = [(0, buffers[m.index].reshape(-1))]
            entries[optim_key(MOMENTUM_KEY, m.name)] = fragments(
                m.slot.numel, pieces, self.momentum_dtype, self._where())
        return entries, buffers

    def install(self, buffers: dict[int, torch.Tensor] | None) -> None:
        """Take loaded momentum (None: the checkpoint had none; Muon starts afresh)."""
        self.staged.clear()
        self.momentum = dict(buffers or {})
        self.started = buffers is not None and bool(self.matrices)

    def _device(self) -> torch.device:
        """The compute device: where the exchange and Newton-Schulz run."""
        return self.matrices[0].unit.compute_device if self.matrices else torch.device("cpu")

    def _where(self) -> torch.device:
        """Where the momentum lives."""
        return torch.device("cpu") if self.place == "cpu" else self._device()
