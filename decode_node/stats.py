"""A decode node's counters, published with each heartbeat (NodeInfo names), and
its histograms (exported on /metrics only)."""

from __future__ import annotations

from dataclasses import dataclass, field

from common.metrics.histogram import Histogram
from common.metrics.phases import PhaseHistograms
from common.runtime.reliability import AbortCounters


@dataclass(slots=True)
class DecodeStats:
    requests: int = 0
    remote_prefills: int = 0
    local_prefills: int = 0
    transfers_landed: int = 0
    late_transfers: int = 0
    transfer_failures: int = 0
    checksum_mismatches: int = 0
    bytes_received: int = 0
    leases_expired: int = 0
    rejected: int = 0  # refused for lack of room (RESOURCE_EXHAUSTED)
    aborts: AbortCounters = field(default_factory=AbortCounters)
    # Per request this node prefilled itself: its queue and prefill time here.
    phases: PhaseHistograms = field(default_factory=PhaseHistograms)

    def histograms(self) -> dict[str, Histogram]:
        return self.phases.histograms()

    def counters(self) -> dict[str, int]:
        return {
            **self.aborts.counters(),
            "leases_expired": self.leases_expired,
            "rejected": self.rejected,
            "requests_total": self.requests,
            "kv_transfers": self.transfers_landed,
            "kv_transfer_failures": self.transfer_failures,
            "kv_late_transfers": self.late_transfers,
            "kv_checksum_mismatches": self.checksum_mismatches,
            "kv_transfer_bytes": self.bytes_received,
        }
