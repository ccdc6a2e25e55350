"""KV index: which (worker, dp_rank) slot holds which prefix of blocks (DESIGN §3.5).

(Skeleton: API only; implementation follows.)
"""

from collections.abc import Mapping, Sequence

from dynamograph.protocol.kv_events import KvEvent

Slot = tuple[int, int]


class KvIndex:
    def apply_events(
        self, slot: Slot, events: Sequence[KvEvent], lora_names: Mapping[int, str] | None = None
    ) -> None:
        """Apply vLLM events of one slot: BlockStored (token ids → our hashes), BlockRemoved
        (engine hashes), AllBlocksCleared."""
        raise NotImplementedError

    def clear(self, slot: Slot) -> None:
        raise NotImplementedError

    def remove_worker(self, worker_id: int) -> None:
        raise NotImplementedError

    def record(self, slot: Slot, block_hashes: Sequence[int], expires_at: float) -> None:
        """Approximate mode: count these blocks as cached on `slot` until `expires_at`."""
        raise NotImplementedError

    def expire(self, now: float) -> None:
        raise NotImplementedError

    def find_matches(self, block_hashes: Sequence[int]) -> dict[Slot, int]:
        """{slot: number of leading blocks of the request the slot holds}, for slots with > 0."""
        raise NotImplementedError
