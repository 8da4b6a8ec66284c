"""The warm-restart index of a region (docs/warm-restart.md): which chunk slot holds the complete
bytes of which key, kept beside the region (vllm_offload_<id>.index) so a restarted engine of
the same identity starts warm.

- `format`: the file's header layout, the identity document, the outcome block, parse_header
  (pure Python; what every reader checks);
- `reader`: the agent's read of the last engine's outcome (one pread, never a lock);
- `writer`: the one engine's side: RegionIndex (open, lock, adopt, the commit protocol) and
  remove_index. Only the plugin's scheduler imports it; the agent never does.

Nothing is imported here: a reader that imports `reader` loads no writer.
"""
