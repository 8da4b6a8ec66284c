"""Run at the start of every Python process of the engine benchmark (run.py puts this
directory first on PYTHONPATH), so also in the processes vLLM starts itself (its model
inspection runs `python -m vllm.model_executor.models.registry`): where vLLM's compiled
extension `vllm._C_stable_libtorch` is absent, importing it gives an empty module instead of
failing (vllm/platforms/cuda.py imports it unconditionally). A finder placed last: it answers
only for that name, and only when no other finder found vLLM's own module."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Sequence
from types import ModuleType

EMPTY_EXTENSION = "vllm._C_stable_libtorch"


class EmptyExtension(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != EMPTY_EXTENSION:
            return None
        return importlib.machinery.ModuleSpec(fullname, self, origin="kvshm engine bench stand-in")

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return None

    def exec_module(self, module: ModuleType) -> None:
        return None


sys.meta_path.append(EmptyExtension())
