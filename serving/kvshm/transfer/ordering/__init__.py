"""Where a handler's jobs run, one after another: a thread for the CPU backend, CUDA streams
and events for the GPU (the ordering half of the handler contract)."""
