"""The comm ledger: bytes moved per collective kind, and their inter-host share (the ring model of
`comm.py`'s docstring). One ledger per `World` (`world.py`): the world's Comm and every subgroup
made from it (`groups.py`) count into it, so a rank's report covers its whole step whichever
group moved the bytes."""

from __future__ import annotations

from collections import defaultdict

#: The kinds every report lists, present or not.
KINDS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all", "step_check")


class Ledger:
    """Cumulative bytes per collective kind, with the part of them that crossed hosts."""

    def __init__(self):
        self.bytes: defaultdict[str, int] = defaultdict(int)
        self.inter_host_bytes: defaultdict[str, int] = defaultdict(int)

    def add(self, kind: str, moved: int, inter_host: int) -> None:
        """Count `moved` bytes of collective `kind`, `inter_host` of them across hosts."""
        self.bytes[kind] += moved
        self.inter_host_bytes[kind] += inter_host

    def report(self) -> dict[str, int]:
        """Bytes per kind, "total", and its split: "intra_host" + "inter_host" = "total"."""
        out = {k: int(self.bytes.get(k, 0)) for k in KINDS}
        out.update((k, int(v)) for k, v in self.bytes.items() if k not in out)  # any other kind
        out["total"] = sum(out.values())
        inter = int(sum(self.inter_host_bytes.values()))
        out["intra_host"], out["inter_host"] = out["total"] - inter, inter
        return out

    def reset(self) -> None:
        """Zero the counts (e.g. to measure one step)."""
        self.bytes.clear()
        self.inter_host_bytes.clear()
