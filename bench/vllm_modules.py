"""vLLM 0.33's region code, loaded from a small set of its source files without installing vLLM.

The benchmarks time vLLM's own `SharedOffloadRegion` (create, join, populate, segment files),
`host_register`/`host_unregister` and `pin_mmap_region`. On a GPU machine with no vLLM
installed (its wheel is too large to carry), they load those from a directory holding a few of
vLLM's files, extracted from the wheel by `scripts/extract-vllm-bench-src.sh` into `.vllm-src/`.

What runs is vLLM's, and what is plumbing:

- vLLM's files, imported whole and unchanged: `vllm/v1/kv_offload/cpu/shared_offload_region.py`
  and `host_register.py` (the code under test), `vllm/distributed/device_communicators/
  cuda_wrapper.py` (the ctypes libcudart calls `host_register` makes), `vllm/logger.py`,
  `vllm/envs.py`, `vllm/logging_utils/formatter.py`, `vllm/utils/math_utils.py`.
- vLLM's definitions, taken unchanged from its files (parsed, the named top-level statements
  compiled with their file name and line numbers) because the rest of those files imports
  half of vLLM: `pin_mmap_region` and its two constants from `v1/kv_offload/cpu/gpu_worker.py`
  (how `CPUOffloadingWorker` pins the region); `check_shm_free_space` from
  `distributed/device_communicators/shm_broadcast.py` and the cgroup check it calls from
  `utils/cpu_resource_utils.py` (the creator's free-space check); `find_loaded_library` from
  `utils/system_utils.py` (how `CudaRTLibrary` finds libcudart). Each such module also runs
  the file's own imports of the standard library and of the modules above.
- Plumbing, not vLLM's: the parent packages (`vllm`, `vllm.v1`, ..., `vllm.logging_utils`)
  are empty modules whose search path is the extracted directory, so their `__init__.py`
  (which imports vLLM's engine) never runs; `vllm.logging_utils` exposes the formatter
  classes `vllm/logger.py` imports from it; and `vllm.platforms.current_platform` is a stand-in
  that answers `is_cuda_alike()` from torch (CUDA build with a visible device), `is_rocm()`
  and `is_xpu()` False, so `host_register` takes its CUDA path where vLLM's platform
  detection would; `vllm.distributed.parallel_state` is a stand-in whose `is_local_first_rank`
  and `is_global_first_rank` answer True, as vLLM's do when torch.distributed is not
  initialized (only vLLM's logger's `*_once` methods ask them).

    python3 bench/vllm_modules.py extract <vllm wheel> <directory>   # what the script runs
    python3 bench/vllm_modules.py check [<directory>]                 # load and list what ran
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import importlib
import importlib.util
import symtable
import sys
import types
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
DEFAULT_SOURCE = REPO / ".vllm-src"
VERSION_FILE = "VLLM_WHEEL"  # written by extract: the wheel's name and sha256


@dataclass(frozen=True)
class Partial:
    """A module made of some top-level definitions of one of vLLM's files."""

    module: str
    names: tuple[str, ...]


WHOLE_MODULES = (
    "vllm.envs",
    "vllm.logging_utils.formatter",
    "vllm.logger",
    "vllm.utils.math_utils",
    "vllm.distributed.device_communicators.cuda_wrapper",
    "vllm.v1.kv_offload.cpu.host_register",
    "vllm.v1.kv_offload.cpu.shared_offload_region",
)
PARTIAL_MODULES = (
    Partial("vllm.utils.system_utils", ("find_loaded_libraries", "find_loaded_library")),
    Partial(
        "vllm.utils.cpu_resource_utils",
        (
            "logger",
            "_read_int_file",
            "get_cgroup_memory_limit",
            "get_cgroup_memory_usage",
            "check_cgroup_memory_available",
        ),
    ),
    Partial(
        "vllm.distributed.device_communicators.shm_broadcast",
        ("logger", "SHM_PATH", "check_shm_free_space"),
    ),
    Partial(
        "vllm.v1.kv_offload.cpu.gpu_worker",
        (
            "logger",
            "MAX_HOST_REGISTER_CHUNK_BYTES",
            "MIN_HOST_REGISTER_SAVED_BYTES",
            "pin_mmap_region",
        ),
    ),
)
PACKAGES = (
    "vllm",
    "vllm.v1",
    "vllm.v1.kv_offload",
    "vllm.v1.kv_offload.cpu",
    "vllm.distributed",
    "vllm.distributed.device_communicators",
    "vllm.utils",
    "vllm.logging_utils",
)
# Import order: each module's vLLM imports are loaded before it.
LOAD_ORDER: tuple[str | Partial, ...] = (
    "vllm.envs",
    "vllm.logging_utils.formatter",
    "vllm.logger",
    "vllm.utils.math_utils",
    PARTIAL_MODULES[0],
    PARTIAL_MODULES[1],
    PARTIAL_MODULES[2],
    "vllm.distributed.device_communicators.cuda_wrapper",
    "vllm.v1.kv_offload.cpu.host_register",
    "vllm.v1.kv_offload.cpu.shared_offload_region",
    PARTIAL_MODULES[3],
)


def source_files() -> list[str]:
    """The files of vLLM's wheel the benchmarks need, relative to its root."""
    modules = [*WHOLE_MODULES, *(partial.module for partial in PARTIAL_MODULES)]
    return sorted(module.replace(".", "/") + ".py" for module in modules)


def extract(wheel: Path, destination: Path) -> list[Path]:
    """Copy source_files() out of vLLM's wheel into destination/vllm/..., and record the wheel."""
    written = []
    with zipfile.ZipFile(wheel) as archive:
        for name in source_files():
            target = destination / name
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(archive.read(name))
            written.append(target)
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    (destination / VERSION_FILE).write_text(f"{wheel.name} sha256={digest}\n")
    return written


class _PlatformStandIn:
    """Plumbing for vllm.platforms.current_platform: what host_register asks of it."""

    def __init__(self) -> None:
        import torch

        self._cuda = bool(torch.version.cuda) and torch.cuda.is_available()
        self.device_name = "cuda" if self._cuda else "cpu"

    def is_cuda_alike(self) -> bool:
        return self._cuda

    def is_rocm(self) -> bool:
        return False

    def is_xpu(self) -> bool:
        return False


@dataclass
class VllmModules:
    """vLLM's modules as loaded, and where from."""

    root: Path
    wheel: str
    modules: dict[str, types.ModuleType]

    @property
    def shared_offload_region(self) -> Any:
        return self.modules["vllm.v1.kv_offload.cpu.shared_offload_region"]

    @property
    def SharedOffloadRegion(self) -> Any:
        return self.shared_offload_region.SharedOffloadRegion

    @property
    def host_register(self) -> Any:
        return self.modules["vllm.v1.kv_offload.cpu.host_register"]

    @property
    def pin_mmap_region(self) -> Any:
        return self.modules["vllm.v1.kv_offload.cpu.gpu_worker"].pin_mmap_region

    def describe(self) -> str:
        return f"vLLM {self.wheel} from {self.root}"

    def files(self) -> dict[str, str]:
        return {name: str(module.__file__) for name, module in self.modules.items()}


def default_root() -> Path:
    """.vllm-src if it was extracted, else the installed vLLM's directory (never imported)."""
    if (DEFAULT_SOURCE / "vllm").is_dir():
        return DEFAULT_SOURCE
    spec = importlib.util.find_spec("vllm")  # finds the package without running __init__
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(
            "vLLM 0.33's sources are not here: run scripts/extract-vllm-bench-src.sh (it writes "
            ".vllm-src/), pass --vllm-src DIR, or install vllm==0.33.0 with --no-deps"
        )
    return Path(next(iter(spec.submodule_search_locations))).parent


def load(root: Path | None = None) -> VllmModules:
    """Load vLLM's region modules from root/vllm/... as described in this module's docstring."""
    root = (root or default_root()).resolve()
    if "vllm" in sys.modules and not getattr(sys.modules["vllm"], "_kvshm_bench_stand_in", False):
        raise RuntimeError("vllm is already imported: load() must run before anything imports it")
    if not (root / "vllm" / "v1" / "kv_offload" / "cpu" / "shared_offload_region.py").is_file():
        raise SystemExit(f"{root} holds no vllm/v1/kv_offload/cpu/shared_offload_region.py")
    for package in PACKAGES:
        module = types.ModuleType(package)
        module.__path__ = [str(root / package.replace(".", "/"))]
        module._kvshm_bench_stand_in = True  # type: ignore[attr-defined]
        sys.modules[package] = module
        parent, _, child = package.rpartition(".")
        if parent:
            setattr(sys.modules[parent], child, module)
    platforms = types.ModuleType("vllm.platforms")  # plumbing; host_register imports it
    platforms.current_platform = _PlatformStandIn()  # type: ignore[attr-defined]
    sys.modules["vllm.platforms"] = platforms
    sys.modules["vllm"].platforms = platforms  # type: ignore[attr-defined]
    # plumbing for vLLM's logger's *_once methods: with torch.distributed not initialized (as
    # here) vLLM's own is_local_first_rank / is_global_first_rank answer True
    parallel_state = types.ModuleType("vllm.distributed.parallel_state")
    parallel_state.is_local_first_rank = lambda: True  # type: ignore[attr-defined]
    parallel_state.is_global_first_rank = lambda: True  # type: ignore[attr-defined]
    sys.modules["vllm.distributed.parallel_state"] = parallel_state

    loaded: dict[str, types.ModuleType] = {}
    for item in LOAD_ORDER:
        if isinstance(item, Partial):
            loaded[item.module] = _load_partial(root, item)
        else:
            loaded[item] = importlib.import_module(item)
            if item == "vllm.logging_utils.formatter":
                formatter = loaded[item]
                stand_in = sys.modules["vllm.logging_utils"]
                stand_in.ColoredFormatter = formatter.ColoredFormatter  # type: ignore[attr-defined]
                stand_in.NewLineFormatter = formatter.NewLineFormatter  # type: ignore[attr-defined]
        file = Path(str(loaded[item if isinstance(item, str) else item.module].__file__))
        if not file.resolve().is_relative_to(root):
            raise RuntimeError(f"{file} was loaded from outside {root}")
    wheel_file = root / VERSION_FILE
    wheel = wheel_file.read_text().split()[0] if wheel_file.is_file() else _installed_version(root)
    return VllmModules(root, wheel, loaded)


def _installed_version(root: Path) -> str:
    dist_infos = sorted(root.glob("vllm-*.dist-info"))
    return dist_infos[0].name.removesuffix(".dist-info") if dist_infos else "(version unknown)"


def _is_available(module: str) -> bool:
    """Whether an import statement of this module may run: the standard library, or one of
    vLLM's modules this loader provides."""
    if module.split(".")[0] in sys.stdlib_module_names:
        return True
    loaded = sys.modules.get(module)
    return loaded is not None and not getattr(loaded, "_kvshm_bench_stand_in", False)


def _load_partial(root: Path, partial: Partial) -> types.ModuleType:
    path = root / (partial.module.replace(".", "/") + ".py")
    source = path.read_text()
    tree = ast.parse(source, str(path))
    imports: list[ast.stmt] = []
    chosen: dict[str, ast.stmt] = {}
    for node in tree.body:
        if isinstance(node, ast.Import):
            if all(_is_available(alias.name) for alias in node.names):
                imports.append(node)
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0 and node.module and _is_available(node.module):
                imports.append(node)
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name in partial.names:
            chosen[node.name] = node
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                if isinstance(target, ast.Name) and target.id in partial.names:
                    chosen[target.id] = node
    missing = set(partial.names) - set(chosen)
    if missing:
        raise RuntimeError(f"{path} defines no {sorted(missing)}: not vLLM 0.33's file?")
    module = types.ModuleType(partial.module)
    module.__file__ = str(path)
    sys.modules[partial.module] = module
    parent, _, child = partial.module.rpartition(".")
    setattr(sys.modules[parent], child, module)
    # keep the file's order: constants before the functions that read them
    body = [node for node in tree.body if node in imports or node in chosen.values()]
    code = compile(ast.Module(body=body, type_ignores=[]), str(path), "exec")
    exec(code, module.__dict__)
    _check_names_resolve(source, str(path), partial, module)
    return module


def _check_names_resolve(
    source: str, path: str, partial: Partial, module: types.ModuleType
) -> None:
    """Every global name the chosen functions read exists, so no call fails later."""
    import builtins

    def globals_of(table: symtable.SymbolTable) -> set[str]:
        names = {
            symbol.get_name()
            for symbol in table.get_symbols()
            if symbol.is_global() and symbol.is_referenced()
        }
        for child in table.get_children():
            names |= globals_of(child)
        return names

    top = symtable.symtable(source, path, "exec")
    for child in top.get_children():
        if child.get_name() in partial.names and child.get_type() == "function":
            unknown = {
                name
                for name in globals_of(child)
                if name not in module.__dict__ and not hasattr(builtins, name)
            }
            if unknown:
                raise RuntimeError(
                    f"{path}: {child.get_name()} reads {sorted(unknown)}, not loaded"
                )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    extract_parser = sub.add_parser("extract", help="copy the needed files out of vLLM's wheel")
    extract_parser.add_argument("wheel", type=Path)
    extract_parser.add_argument("destination", type=Path)
    check_parser = sub.add_parser("check", help="load vLLM's modules and list where from")
    check_parser.add_argument("root", type=Path, nargs="?")
    args = parser.parse_args()
    if args.command == "extract":
        for path in extract(args.wheel, args.destination):
            print(path)
        return
    modules = load(args.root)
    print(modules.describe())
    for name, file in modules.files().items():
        print(f"  {name:<52} {file}")
    print(f"  SharedOffloadRegion: {modules.SharedOffloadRegion}")


if __name__ == "__main__":
    main()
