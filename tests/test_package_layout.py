"""The package's shape stays as designed: subsystems as folders, imports running one way (config and
dist at the bottom, then core, then offload / checkpoint / sizing, then the engine, then the
command line, integrations and public names), no import cycles, and every public import path
users and the docs rely on still importing."""

from __future__ import annotations

import ast
import importlib
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).parent.parent / "src" / "zeroshard"

# Layer of each top-level name of the package: a module may import from its own layer or below.
LAYERS = {
    "dist": 0, "config": 0,
    "core": 1,
    "offload": 2, "checkpoint": 2, "sizing": 2,
    "activations": 2,  # deepspeed.checkpointing on torch.utils.checkpoint
    "monitor": 3,  # what the engine reports (writers, throughput, timers); core must not import it
    "engine": 3, "schedulers": 3, "build": 3,
    "cli": 4, "integrations": 4, "__init__": 4, "zero": 4, "ops": 4, "utils": 4,
    "estimate": 4, "consolidate": 4, "accelerator": 4,
    "comm": 4,  # DeepSpeed's deepspeed.comm names; zeroshard's own code imports dist
}


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """Modules of the package that `name` imports (anywhere in the file, lazy imports included)."""
    is_package = path.name == "__init__.py"
    base = name.split(".") if is_package else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = ".".join(base[:len(base) - node.level + 1] + [node.module or ""]).strip(".") \
                if node.level else node.module or ""
            targets = [module] + [f"{module}.{alias.name}" for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, set(modules)) for name, path in modules.items()}


def _top(name: str) -> str:
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def test_every_top_level_name_has_a_layer():
    tops = {_top(name) for name in _modules()}
    assert tops <= set(LAYERS), f"place {sorted(tops - set(LAYERS))} in LAYERS"


def test_imports_run_one_way():
    wrong = []
    for name, targets in _graph().items():
        for target in targets:
            if _top(target) == "__init__" and name.startswith("zeroshard."):
                continue  # `from .. import __version__` / the public names, from the top layer
            if LAYERS[_top(target)] > LAYERS[_top(name)]:
                wrong.append(f"{name} -> {target}")
    assert not wrong, "imports against the layering: " + ", ".join(sorted(wrong))


def test_no_import_cycles():
    graph = _graph()
    # A package's __init__ re-exporting its children is not a cycle of design.
    graph = {m: {t for t in ts if not (PACKAGE.parent / Path(*t.split("."))).is_dir()}
             for m, ts in graph.items()}
    state: dict[str, int] = {}  # 1 on the stack, 2 done
    cycles = []

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, stack)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [])
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_the_cycle_check_finds_a_cycle(tmp_path, monkeypatch):
    """The checker itself can fail: a two-module package importing each other is reported."""
    package = tmp_path / "zeroshard"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from .b import x\n")
    (package / "b.py").write_text("def x():\n    from .a import y\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", package)
    with pytest.raises(AssertionError, match="zeroshard.a -> zeroshard.b -> zeroshard.a"):
        test_no_import_cycles()


@pytest.mark.parametrize("path, names", [
    ("zeroshard", ["initialize", "prepare", "Init", "GatheredParameters", "init_distributed",
                   "add_config_arguments", "load_config", "ConfigError", "Engine", "Accelerator",
                   "DeepSpeedPlugin", "get_accelerator", "checkpointing", "monitor"]),
    ("zeroshard.accelerator", ["get_accelerator", "CpuAccelerator", "CudaAccelerator"]),
    ("zeroshard.integrations.accelerate", ["Accelerator", "DeepSpeedPlugin"]),
    ("zeroshard.integrations.deepspeed_alias", ["install", "UnsupportedError"]),
    ("zeroshard.zero", ["Init", "GatheredParameters", "ZeroParamStatus", "load_full_state_dict"]),
    ("zeroshard.ops.adam", ["DeepSpeedCPUAdam", "FusedAdam"]),
    ("zeroshard.utils.zero_to_fp32", ["get_fp32_state_dict_from_zero_checkpoint"]),
    ("zeroshard.integrations.hf", ["ZeroTrainer"]),
    ("zeroshard.integrations.lightning", ["ZeroShardStrategy"]),
    ("zeroshard.checkpoint", ["CheckpointError", "save_checkpoint", "load_checkpoint"]),
    ("zeroshard.estimate", ["estimate", "model_states", "Shape", "GB"]),
    ("zeroshard.consolidate", ["consolidate", "consolidated_state_dict"]),
    ("zeroshard.config", ["load_config", "ConfigError", "ConfigWarning", "ZeroConfig"]),
    ("zeroshard.comm", ["init_distributed", "get_rank", "get_world_size", "all_reduce"]),
    ("zeroshard.cli", ["main"]),
])
def test_public_import_paths_keep_working(path, names):
    module = importlib.import_module(path)
    missing = [n for n in names if not hasattr(module, n)]
    assert not missing, f"{path} lacks {missing}"
