"""Choosing each direction's copy backend from a short measurement on this host, cached per
host and layout (the vLLM plugin's kvshm_calibrate, on by default): the measured twin of
kvshm.transfer.choice.chooser, whose per-block-size policy it overrides.

The measurement runs once, at the worker's first transfer, before that transfer: every backend
the handlers could use moves the same jobs between scratch GPU blocks (never the engine's KV
cache) and this worker's own cells of the region, which hold nothing yet (vLLM's CPU tier
starts empty and its first job is a store): stores alone, loads alone, and every pair of store
and load backends both ways at once. The pair with the least time over the three is kept in a
JSON file keyed by host (name, GPU, driver) and layout (every tensor's page size in order,
whether the tensors are one allocation, blocks_per_chunk), so later starts on the host reuse it
without measuring.

One job a module, each importing only those below it:

- calibrate: choose(), the cached choice for this host and layout, else a measurement's;
- measurement: the timing runner (measure(), Measurement);
- cache: ChoiceCache, the JSON file in a directory others may write, and its keys;
- workload: the scratch GPU blocks and the jobs every trial moves;
- policy: which backends a measurement tries, and how a choice is made of its times.
"""

from kvshm.transfer.calibration.cache import ChoiceCache, UnusableCacheError
from kvshm.transfer.calibration.calibrate import choose
from kvshm.transfer.calibration.measurement import HandlerFactory, Measurement
from kvshm.transfer.calibration.policy import CHOICES

__all__ = [
    "CHOICES",
    "ChoiceCache",
    "HandlerFactory",
    "Measurement",
    "UnusableCacheError",
    "choose",
]
