"""kvshm's own CUDA plumbing: the driver through ctypes, streams outside torch's pool, and
pinned descriptor tables lent to jobs. Each loads CUDA on first use, never at import."""
