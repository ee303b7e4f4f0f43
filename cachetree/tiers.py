"""Storage tiers a rank may hold a block on, as bits, and the engine `medium` names for them.

A carrier's tier set is a small bitmask. DEVICE is the fast tier routing counts fully; the
others are slower copies a rank can reload from. The mapping covers both vLLM's spelling
(`CPU`, `STORAGE`) and SGLang's (`CPU_PINNED`, `DISK`, `EXTERNAL`).
"""

from __future__ import annotations

from typing import Final

DEVICE: Final = 1
HOST: Final = 2
DISK: Final = 4
EXTERNAL: Final = 8
ALL_TIERS: Final = DEVICE | HOST | DISK | EXTERNAL

TIER_NAMES: Final[dict[int, str]] = {
    DEVICE: "device",
    HOST: "host",
    DISK: "disk",
    EXTERNAL: "external",
}

# Keys are upper-cased before lookup, so "gpu" and "GPU" agree.
MEDIUM_TIERS: Final[dict[str, int]] = {
    "GPU": DEVICE,
    "CPU": HOST,
    "CPU_PINNED": HOST,
    "DISK": DISK,
    "NVME": DISK,
    "STORAGE": DISK,
    "EXTERNAL": EXTERNAL,
}


def tier_of_medium(medium: str | None) -> int:
    """The tier bit for an engine `medium`: DEVICE when absent, 0 when the name is unknown."""
    if medium is None:
        return DEVICE
    return MEDIUM_TIERS.get(medium.upper(), 0)
