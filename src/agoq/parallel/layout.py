"""The pipeline layout as one value: what the schedule, stage-bits and planning code all need to know.

(pp, dp, virtual stages, schedule, micro-batches) travelled as four or five loose arguments through
every function that splits layers, orders a schedule or sizes its stages; a :class:`PipelineLayout`
is checked once (:func:`agoq.parallel.pipeline.check_schedule`) and answers those questions itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from agoq.parallel.inflight import schedule_order
from agoq.parallel.pipeline import check_schedule, split_layers, stage_to_rank


@dataclass(frozen=True)
class PipelineLayout:
    """pp pipeline ranks of ``virtual_stages`` stages each, run by ``schedule`` over ``microbatches``
    micro-batches per step, replicated over ``dp`` data-parallel ranks (which changes none of the
    pipeline's shape). Construction checks the combination; ``schedule`` is kept as given and
    :attr:`key` is torch's canonical name for it."""

    schedule: str
    pp: int
    microbatches: int
    virtual_stages: int = 1
    dp: int = 1
    key: str = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.dp < 1:
            raise ValueError(f"dp={self.dp} must be >= 1")
        object.__setattr__(self, "key", check_schedule(self.schedule, self.pp, self.microbatches, self.virtual_stages))

    @property
    def num_stages(self) -> int:
        """Pipeline stages in all: pp x virtual stages."""
        return self.pp * self.virtual_stages

    def stage_ranges(self, n_layers: int) -> list[range]:
        """The layers of each global stage, in order."""
        return split_layers(n_layers, self.pp, self.virtual_stages)

    def stage_ranks(self) -> list[int]:
        """The pipeline rank that runs each global stage."""
        return stage_to_rank(self.key, self.pp, self.virtual_stages)

    def order(self) -> dict[int, list[Any]]:
        """torch's action order of one step, per pipeline rank (what in-flight counts are read off)."""
        return schedule_order(self.key, self.pp, self.microbatches, self.virtual_stages)
