"""Pure data structures for the block index: keys, the tree, snapshots. No I/O, no asyncio."""
