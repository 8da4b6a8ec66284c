"""tests/vllm: kvshm's vLLM 0.33 plugin against vLLM's own code (installed with --no-deps).

vLLM picks its platform at import: these tests parse engine flags with the CPU platform (on
the GPU machine too: only the KV tensors live on the GPU there).
"""

from __future__ import annotations

import os

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
