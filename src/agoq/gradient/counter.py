"""Bytes each rank puts on the wire, per collective, split into quantized payload and scales.

Counts are algorithmic, as nccl-tests' "bus bytes" are: an all-to-all of W rows sends the W - 1
rows that leave the rank; an all-gather of an m-byte chunk costs each rank (W - 1) * m (every
chunk must reach W - 1 peers, as in a ring); a ring all-reduce of N bytes sends 2 (W - 1) / W * N.
Padding is counted: it travels. Transport headers (TCP, gloo framing) are not.
"""

from __future__ import annotations

from dataclasses import dataclass, field


def ring_all_reduce_bytes(nbytes: int, world_size: int) -> int:
    """Bytes one rank sends in a ring all-reduce of ``nbytes``: 2 (W - 1) / W * nbytes."""
    return 2 * (world_size - 1) * nbytes // world_size if world_size > 1 else 0


@dataclass
class CommCounter:
    """Bytes this rank sent, per collective name, split into payload and scale bytes."""

    payload: dict[str, int] = field(default_factory=dict)
    scales: dict[str, int] = field(default_factory=dict)
    calls: dict[str, int] = field(default_factory=dict)

    def record(self, name: str, payload_bytes: int, scale_bytes: int = 0, calls: int = 1) -> None:
        """Add one call of collective ``name`` that sent the given bytes."""
        self.payload[name] = self.payload.get(name, 0) + int(payload_bytes)
        self.scales[name] = self.scales.get(name, 0) + int(scale_bytes)
        self.calls[name] = self.calls.get(name, 0) + calls

    def bytes(self, name: str | None = None) -> int:
        """Payload plus scale bytes sent by collective ``name`` (all collectives if None)."""
        if name is None:
            return sum(self.payload.values()) + sum(self.scales.values())
        return self.payload.get(name, 0) + self.scales.get(name, 0)

    def reset(self) -> None:
        """Forget every count."""
        self.payload.clear()
        self.scales.clear()
        self.calls.clear()

    def as_dict(self) -> dict[str, dict[str, int]]:
        """{name: {"payload": bytes, "scales": bytes, "total": bytes, "calls": n}} for metrics."""
        return {
            name: {
                "payload": self.payload.get(name, 0),
                "scales": self.scales.get(name, 0),
                "total": self.bytes(name),
                "calls": self.calls.get(name, 0),
            }
            for name in sorted(set(self.payload) | set(self.scales))
        }


# Every collective records here unless given its own counter, so a trainer can read one place.
COMM_COUNTER = CommCounter()
