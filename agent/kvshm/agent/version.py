"""The agent's version: the installed kvshm distribution's."""

from __future__ import annotations

from importlib import metadata


def agent_version() -> str:
    try:
        return metadata.version("kvshm")
    except metadata.PackageNotFoundError:
        return "0+unknown"
