"""The package's shape stays as designed: subsystems as folders, imports running one way (config and
dist at the bottom, then core, then offload / checkpoint / sizing, then the engine, then the
command line, compat/ and public names; inside core, its own sub-layers from the layout up to the
optimizer), no import cycles, `import zeroshard` loading nothing of compat/, and every public
import path users and the docs rely on still importing."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).parent.parent / "src" / "zeroshard"

# Layer of each top-level name of the package: a module may import from its own layer or below.
LAYERS = {
    "dist": 0, "config": 0,
    "core": 1,  # with sub-layers of its own: CORE_LAYERS below
    "offload": 2, "checkpoint": 2, "sizing": 2,
    "activations": 2,  # deepspeed.checkpointing on torch.utils.checkpoint
    "monitor": 3,  # what the engine reports (writers, throughput, timers); core must not import it
    "engine": 3, "schedulers": 3, "build": 3, "train_state": 3,
    # compat/: everything that imitates another library (DeepSpeed, Accelerate, Hugging Face,
    # Lightning). Nothing below this layer imports it; core reaches the Hugging Face init walk
    # through core.init.register_library_hooks, wired in __init__.
    "compat": 4,
    "cli": 4, "__init__": 4, "estimate": 4, "consolidate": 4,
    # Documented paths that are the very modules of their homes in compat/.
    "integrations": 4, "accelerator": 4,
}


# core/'s sub-layers, bottom first (DESIGN.md's layout -> stages/zeropp -> construct -> runtime,
# while they share one folder): a core module may import its own sub-layer or one below.
CORE_ORDER = ["base", "layout", "strategies", "stages", "construct", "optimizer", "build"]
CORE_LAYERS = {
    # Helpers every part uses: the owner registry, the checkpoint key names, the step-count
    # check, the training state, the extensions registry (host memory, streams, host syncs,
    # groups and the watchdog are dist/'s).
    "base": {"", "owners", "keys", "step_check", "training_state", "extensions"},
    # The one layout: units, flat buffers, shards; stage 3's unit plan (also Init's) and the
    # units taking their memory at initialize() (materialize).
    "layout": {"layout", "leaf", "partition", "init_units", "materialize"},
    # Gather and reduce strategies (ZeRO++ qwZ / hpZ / qgZ, MiCS), composed into a stage.
    "strategies": {"strategies", "mics", "zeropp", "zeropp.collectives", "zeropp.hpz",
                   "zeropp.qgz", "zeropp.qwz", "zeropp.quantize"},
    # The stage policies over the layout, and what only they use.
    "stages": {"spec", "reduction", "policy", "stage0", "stage1", "stage2", "stage3", "schedule",
               "grad_reducer", "param_gatherer", "stage3_hooks",
               "shard_store", "stage3_reads", "policy_view"},
    # Building a model partitioned (Init) and gathering it back (GatheredParameters).
    "construct": {"init", "gathered", "sanity"},
    # The sharded optimizer over a stage: its step, state dict, loss scaler, Muon, Lion.
    "optimizer": {"optim", "grad_norm", "state", "fragments", "fragment_grads", "muon", "muon_exchange", "lion",
                  "scaler", "no_optimizer", "user_backward"},
    # What only build.py calls: a stage made from its spec (units, policy, strategies), and the
    # ranks' agreement on what they built.
    "build": {"stages", "agreement"},
}
CORE_LAYER = {m: CORE_ORDER.index(layer) for layer, ms in CORE_LAYERS.items() for m in ms}


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


def _in_core(name: str) -> str | None:
    """`name` relative to zeroshard.core ("" for the package itself), or None outside core."""
    if name == "zeroshard.core":
        return ""
    return name[len("zeroshard.core."):] if name.startswith("zeroshard.core.") else None


def test_every_top_level_name_has_a_layer():
    tops = {_top(name) for name in _modules()}
    assert tops <= set(LAYERS), f"place {sorted(tops - set(LAYERS))} in LAYERS"


def test_every_core_module_has_a_sub_layer():
    core = {_in_core(name) for name in _modules()} - {None}
    assert core == set(CORE_LAYER), (f"place {sorted(core - set(CORE_LAYER))} in CORE_LAYERS; "
                                     f"gone: {sorted(set(CORE_LAYER) - core)}")


def test_core_imports_run_one_way():
    """Inside core: the layout below the stages, strategies (ZeRO++, MiCS) below the stages that
    compose them, stages below construct and the optimizer, build.py's stage builder on top."""
    wrong = []
    for name, targets in _graph().items():
        source = _in_core(name)
        if source is None:
            continue
        for target in targets:
            inner = _in_core(target)
            if inner is not None and CORE_LAYER[inner] > CORE_LAYER[source]:
                wrong.append(f"{source} ({CORE_ORDER[CORE_LAYER[source]]}) -> {inner} "
                             f"({CORE_ORDER[CORE_LAYER[inner]]})")
    assert not wrong, "core imports against its sub-layers: " + ", ".join(sorted(wrong))


def test_the_core_layer_check_finds_an_upward_import(monkeypatch):
    """The check can fail: the layout importing the optimizer is reported."""
    graph = _graph()
    graph["zeroshard.core.layout"] = graph["zeroshard.core.layout"] | {"zeroshard.core.optim"}
    monkeypatch.setattr(sys.modules[__name__], "_graph", lambda: graph)
    with pytest.raises(AssertionError, match=r"layout \(layout\) -> optim \(optimizer\)"):
        test_core_imports_run_one_way()


def _ds_attribute_writes(root: Path) -> list[str]:
    """`file:line attr` of each `x.ds_*` assigned or deleted, and each `setattr` / `delattr` of a
    `"ds_*"` name, in the Python files under `root`."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            name = None
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, (ast.Store, ast.Del)):
                name = node.attr
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
                    node.func.id in ("setattr", "delattr") and len(node.args) >= 2 and \
                    isinstance(node.args[1], ast.Constant):
                name = node.args[1].value
            if isinstance(name, str) and name.startswith("ds_"):
                found.append(f"{path.relative_to(root)}:{node.lineno} {name}")
    return found


def test_core_writes_no_deepspeed_attributes():
    """DeepSpeed's `ds_*` attributes are compat/deepspeed/surface.py's to write (through
    core/extensions.py); core holds ZeRO's mechanics only."""
    found = _ds_attribute_writes(PACKAGE / "core")
    assert not found, "core writes DeepSpeed attributes: " + ", ".join(found)


def test_the_ds_attribute_check_finds_writes(tmp_path):
    """The scan can fail: an assignment, a deletion and a setattr are found, a read is not."""
    (tmp_path / "probe.py").write_text(
        "p.ds_status = 1\ndel p.ds_tensor\nsetattr(p, 'ds_id', 2)\nq = p.ds_shape\n")
    assert _ds_attribute_writes(tmp_path) == ["probe.py:1 ds_status", "probe.py:2 ds_tensor",
                                              "probe.py:3 ds_id"]
    # ... and compat's surface, which writes them, is seen by the same scan.
    assert any(f.startswith("deepspeed/surface.py:")
               for f in _ds_attribute_writes(PACKAGE / "compat"))


def test_imports_run_one_way():
    wrong = []
    for name, targets in _graph().items():
        for target in targets:
            if _top(target) == "__init__" and name.startswith("zeroshard."):
                continue  # `from .. import __version__` / the public names, from the top layer
            if LAYERS[_top(target)] > LAYERS[_top(name)]:
                wrong.append(f"{name} -> {target}")
    assert not wrong, "imports against the layering: " + ", ".join(sorted(wrong))


def test_nothing_below_the_top_imports_compat():
    """compat/ stays removable: only the top layer (cli, the public names, the old import paths)
    reaches it."""
    wrong = sorted(f"{name} -> {target}" for name, targets in _graph().items()
                   for target in targets
                   if _top(target) == "compat" and LAYERS[_top(name)] < LAYERS["compat"])
    assert not wrong, "compat imported from below: " + ", ".join(wrong)


def test_import_zeroshard_loads_no_compat():
    """`import zeroshard` imports no look-alike (nor transformers, accelerate, lightning, nor
    torch.compile's dynamo, ~1.3 s): the public names reach compat/ on first use."""
    code = ("import sys, zeroshard; print(sorted(m for m in sys.modules if m.startswith("
            "('zeroshard.compat', 'zeroshard.integrations', 'transformers', 'accelerate', "
            "'lightning', 'torch._dynamo'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout
    code = ("import sys, zeroshard; zeroshard.comm.get_rank(); zeroshard.get_accelerator(); "
            "zeroshard.DeepSpeedPlugin; print(sorted(m for m in sys.modules if m.startswith("
            "('transformers', 'lightning'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


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
    ("zeroshard.integrations.hf", ["ZeroTrainer", "from_pretrained", "from_config"]),
    ("zeroshard.integrations.lightning", ["ZeroShardStrategy"]),
    ("zeroshard.checkpoint", ["CheckpointError", "save_checkpoint", "load_checkpoint"]),
    ("zeroshard.estimate", ["estimate", "model_states", "Shape", "GB"]),
    ("zeroshard.consolidate", ["consolidate", "consolidated_state_dict"]),
    ("zeroshard.config", ["load_config", "ConfigError", "ConfigWarning", "ZeroConfig"]),
    ("zeroshard.cli", ["main"]),
    # DeepSpeed's namespaces as attributes of `import zeroshard as deepspeed` (no modules of
    # their own: zeroshard.__getattr__ answers with their homes in compat/deepspeed/).
    ("zeroshard.zero", ["Init", "GatheredParameters", "ZeroParamStatus", "load_full_state_dict",
                        "register_external_parameter"]),
    ("zeroshard.comm", ["init_distributed", "get_rank", "get_world_size", "all_reduce"]),
    ("zeroshard.ops.adam", ["DeepSpeedCPUAdam", "FusedAdam"]),
    ("zeroshard.ops.adagrad", ["DeepSpeedCPUAdagrad"]),
    ("zeroshard.ops.lion", ["DeepSpeedCPULion", "FusedLion"]),
    ("zeroshard.utils", ["logger", "zero_to_fp32", "set_z3_leaf_modules", "z3_leaf_module"]),
    ("zeroshard.utils.zero_to_fp32", ["get_fp32_state_dict_from_zero_checkpoint"]),
    # Their homes.
    ("zeroshard.compat.deepspeed.zero", ["Init", "GatheredParameters", "ZeroParamStatus"]),
    ("zeroshard.compat.deepspeed.comm", ["get_rank", "all_reduce"]),
    ("zeroshard.compat.deepspeed.accelerator", ["get_accelerator", "CpuAccelerator"]),
    ("zeroshard.compat.deepspeed.ops.adam", ["DeepSpeedCPUAdam", "FusedAdam"]),
    ("zeroshard.compat.deepspeed.ops.adagrad", ["DeepSpeedCPUAdagrad"]),
    ("zeroshard.compat.deepspeed.ops.lion", ["DeepSpeedCPULion", "FusedLion"]),
    ("zeroshard.compat.deepspeed.utils", ["logger", "zero_to_fp32", "set_z3_leaf_modules"]),
    ("zeroshard.compat.deepspeed.utils.zero_to_fp32", ["get_fp32_state_dict_from_zero_checkpoint"]),
    ("zeroshard.compat.deepspeed.alias", ["install", "UnsupportedError", "ALIASES"]),
    ("zeroshard.compat.deepspeed.launcher_flags", ["add_arguments", "apply", "core_assignment"]),
    ("zeroshard.compat.accelerate", ["Accelerator", "DeepSpeedPlugin"]),
    ("zeroshard.compat.accelerate.config", ["ENV", "DeepSpeedPlugin", "launch_env"]),
    ("zeroshard.compat.hf", ["ZeroTrainer", "from_pretrained", "from_config"]),
    ("zeroshard.compat.lightning", ["ZeroShardStrategy"]),
])
def test_public_import_paths_keep_working(path, names):
    """Each path resolves (imported as far as it is a module, then as attributes) and has the
    names."""
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            module = importlib.import_module(".".join(parts[:cut]))
            break
        except ModuleNotFoundError:
            continue
    for part in parts[cut:]:
        module = getattr(module, part)
    missing = [n for n in names if not hasattr(module, n)]
    assert not missing, f"{path} lacks {missing}"


def test_documented_paths_are_their_homes():
    """The documented paths kept outside compat/ are the very module of their home (one set of
    names, nothing to keep in step)."""
    import zeroshard
    import zeroshard.accelerator
    import zeroshard.integrations.hf
    import zeroshard.integrations.lightning

    from zeroshard.compat import hf, lightning
    from zeroshard.compat.deepspeed import accelerator, comm, ops, utils, zero

    assert zeroshard.integrations.hf is hf and zeroshard.integrations.lightning is lightning
    assert zeroshard.accelerator is accelerator
    assert (zeroshard.zero, zeroshard.comm, zeroshard.ops, zeroshard.utils) == \
        (zero, comm, ops, utils)


def test_deepspeed_alias_targets_import():
    """Every zeroshard module the launcher's `import deepspeed` alias maps to exists (the table
    follows the modules when they move)."""
    from zeroshard.compat.deepspeed.alias import ALIASES, RENAMED

    targets = set(ALIASES.values()) | {m for names in RENAMED.values() for m, _ in names.values()}
    missing = []
    for target in sorted(targets):
        try:
            importlib.import_module(target)
        except ImportError as exc:
            missing.append(f"{target} ({exc})")
    assert not missing, f"alias targets that do not import: {missing}"


def _core_classes() -> dict[str, ast.ClassDef]:
    out = {}
    for path in (PACKAGE / "core").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                out[f"{path.relative_to(PACKAGE)}:{node.name}"] = node
    return out


def test_no_class_in_core_is_over_250_lines():
    # Issue 36: core's classes are parts with one job each (the stage-3 policy was one class of
    # 429 lines); a class growing past this is the sign to split off a part.
    long = {name: node.end_lineno - node.lineno + 1 for name, node in _core_classes().items()
            if node.end_lineno - node.lineno + 1 > 250}
    assert not long, long


def test_no_stage_derives_from_another():
    # Stages hold the parts they share (FullGradients, GradReducer, ParamGatherer) instead.
    stages = {name.split(":")[1]: node for name, node in _core_classes().items()
              if name.startswith("core/stage") and name.split(":")[1].startswith("Stage")}
    assert {"Stage0", "Stage1", "Stage2", "Stage3"} <= set(stages), sorted(stages)
    for name, node in stages.items():
        bases = [b.id for b in node.bases if isinstance(b, ast.Name)]
        assert bases == ["StagePolicy"], (name, bases)
