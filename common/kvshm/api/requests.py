"""How long one request to the API server may take, for every kubernetes client call the agent
and the operator make: a server that stops answering ties up the caller (a writer thread, the
agent's pass) for this long at most, and the call fails as a temporary error."""

from __future__ import annotations

from typing import Final

# (connect, read) seconds, as the kubernetes client's _request_timeout takes them
REQUEST_TIMEOUT: Final = (5.0, 30.0)
