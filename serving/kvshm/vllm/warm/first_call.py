"""FirstCall: run a start-up step before whichever of an object's methods is called first, at no
cost to any call after it.

The warm-restart manager starts warm or cold at its first call (vLLM seeds its block hashing
only after it has built the scheduler), and any of five calls can come first. A check at the
top of each of them would cost every later call too: about 50 ns a lookup, 5-7 % of vLLM's own
lookup a key (docs/ARCHITECTURE.md, "Warm restart"). So until the start has run, each of those
methods is shadowed by an instance attribute (found before the class's method) that runs it;
then the shadows are deleted, and the class's methods are what every later call finds.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any


class FirstCall:
    """Shadow each of `methods` on `owner` until `start(name)`, run at the first call of any of
    them, returns True (False: it could not start yet; that call runs the class's method and
    the next call tries again). Then every shadow of its own is deleted, and the call goes on
    to the method the owner has now (an instance attribute the start set stays, as a method of
    its own for the owner's life).

    Shadows are set and deleted as attributes, never through the instance's __dict__: reading
    that materializes the attribute dict and slows every attribute read of the owner's methods
    (vLLM's, on its hot paths) from then on.
    """

    def __init__(
        self, owner: object, methods: tuple[str, ...], start: Callable[[str], bool]
    ) -> None:
        self._owner = owner
        self._start = start
        self._shadows = {name: functools.partial(self._call, name) for name in methods}
        for name, shadow in self._shadows.items():
            setattr(owner, name, shadow)

    @property
    def pending(self) -> bool:
        """Whether the start has still to run."""
        return bool(self._shadows)

    def _call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        owner = self._owner
        if not self._start(name):
            return getattr(type(owner), name)(owner, *args, **kwargs)
        shadows, self._shadows = self._shadows, {}
        for shadowed, shadow in shadows.items():
            if getattr(owner, shadowed) is shadow:  # not one the start set in its place
                delattr(owner, shadowed)
        return getattr(owner, name)(*args, **kwargs)
