"""The identity of one independent KV cache: a worker URL and its data-parallel rank."""

from __future__ import annotations

from typing import NamedTuple


class RankId(NamedTuple):
    worker_url: str
    dp_rank: int

    def __str__(self) -> str:
        return f"{self.worker_url}#dp{self.dp_rank}"
