"""The plugin's warm start (docs/warm-restart.md): the scheduler-side manager that keeps the
region's warm-restart index, so a restarted engine of the same identity starts with every chunk
whose store completed.

- `manager`: KvshmOffloadingManager, vLLM's CPUOffloadingManager keeping the index; it starts
  warm or cold (`_start`) at the first of its calls that can come first (`FIRST_CALLS`);
- `first_call`: FirstCall, which runs that start before whichever call comes first and costs
  no later call anything;
- `journal`: IndexJournal, the one owner of the index's handle: every write goes through it;
- `policies`: vLLM's LRU and ARC, journaled (moved keys, evicted chunks) and restorable;
- `identity`: what decides a block's bytes and key, the identity the index must hold;
- `weights`: the sampled content digest of a model's weight files (part of the identity).

The file format and the commit protocol's writer are kvshm.region.index's.
"""
