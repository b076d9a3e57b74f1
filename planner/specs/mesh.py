"""The rank layout, said once: global rank = ((pp * dp_size + dp) * cp_size + cp) * tp_size + tp,
i.e. torch.arange(world).view(pp, dp, cp, tp) -- tensor parallel fastest, pipeline slowest.

This is DeepSpeed's PipeModelDataParallelTopology (axes pipe, data, model; tests/unit/
test_mesh.py checks it against DeepSpeed's own) with the context-parallel axis between data
and model (Megatron-Core's order tp-cp-dp-pp). Every place that needs a rank's coordinates,
a group of ranks or which ranks share a node asks a Mesh (Plan.mesh, Plan.rank/coords/groups):
the cost model's link sharing, the report's cluster figure, the runtime's topology check.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import NamedTuple

AXES = ("pp", "dp", "cp", "tp")
"""Slowest to fastest."""


class Coords(NamedTuple):
    pp: int
    dp: int
    cp: int
    tp: int


@dataclass(frozen=True, slots=True)
class Mesh:
    pp: int = 1
    dp: int = 1
    cp: int = 1
    tp: int = 1

    @property
    def world(self) -> int:
        return self.pp * self.dp * self.cp * self.tp

    def rank(self, pp: int = 0, dp: int = 0, cp: int = 0, tp: int = 0) -> int:
        """The global rank at these coordinates."""
        return ((pp * self.dp + dp) * self.cp + cp) * self.tp + tp

    def coords(self, rank: int) -> Coords:
        """(pp, dp, cp, tp) indices of a global rank."""
        rank, tp = divmod(rank, self.tp)
        rank, cp = divmod(rank, self.cp)
        pp, dp = divmod(rank, self.dp)
        return Coords(pp, dp, cp, tp)

    def groups(self, axis: str) -> tuple[tuple[int, ...], ...]:
        """Every group of ranks along `axis` (the other coordinates fixed), ordered by the other
        coordinates slowest first: pipeline stage by stage for dp, tp and cp groups."""
        if axis not in AXES:
            raise ValueError(f"axis must be one of {AXES}, got {axis!r}")
        sizes = {a: getattr(self, a) for a in AXES}
        others = [a for a in AXES if a != axis]
        out = []
        for fixed in itertools.product(*(range(sizes[a]) for a in others)):
            at = dict(zip(others, fixed))
            out.append(tuple(self.rank(**at, **{axis: i}) for i in range(sizes[axis])))
        return tuple(out)

    def group(self, axis: str, rank: int) -> tuple[int, ...]:
        """The group of `axis` that holds `rank`."""
        at = self.coords(rank)._asdict()
        return tuple(self.rank(**{**at, axis: i}) for i in range(getattr(self, axis)))


__all__ = ["AXES", "Coords", "Mesh"]
