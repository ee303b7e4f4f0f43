"""Which implementation of the ingest hot spots runs: the compiled accelerator or pure Python.

`cachetree._speedups` (C, built from `cachetree/_speedups.c` when a compiler is there) is an
optional twin of the per-token work: block keys (`cachetree.keys`) and the decoder's token-id
parsing (`router.events`). `cachetree._tables` (`cachetree/_tables.c`) holds the index's tables
in native words (`cachetree.tree` `TreeLayout`): the same maps and nodes as dicts and msgspec
Structs, in about half the memory; the pressure ledger (`router.pressure`) keeps its per-block
table in one of those maps too. Their lookups compare a tag byte per slot before reading an
entry, and a run of lookups (a stored chain, a removed chain, a prompt's path, a ledger
record) prefetches the slots of the lookups ahead of the one it does, so that on an index
larger than the CPU caches the misses overlap. The two are built and chosen together.
Everything in them has a pure-Python twin with the same result, and the test suite runs both ways
(`scripts/test`), so the choice changes speed and memory, never behaviour. It is made once,
at import:

- `KVROUTER_NO_EXTENSIONS` set to anything but "" or "0": the pure path, even when the
  extension is built (to rule it out when debugging, or to measure the difference);
- else the extension when it imports, and the pure path when it is not built (an install
  without a compiler: setup.py marks it optional).

`IMPLEMENTATION` names the choice ("compiled" or "pure") and `REASON` says why; a replica logs
both at start and exports them as `kvrouter_accelerator_info`.
"""

from __future__ import annotations

import os
from types import ModuleType
from typing import Final

NO_EXTENSIONS_ENV: Final = "KVROUTER_NO_EXTENSIONS"


FORCED_PURE: Final = os.environ.get(NO_EXTENSIONS_ENV, "") not in ("", "0")


def _load() -> tuple[ModuleType | None, ModuleType | None, str]:
    if FORCED_PURE:
        return None, None, f"{NO_EXTENSIONS_ENV} is set"
    try:
        from cachetree import _speedups, _tables
    except ImportError as exc:
        return None, None, f"the extension is not built ({exc})"
    return _speedups, _tables, "built and imported"


speedups, tables, REASON = _load()
IMPLEMENTATION: Final = "pure" if speedups is None else "compiled"
