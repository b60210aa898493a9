"""DeepSpeed 0.18-0.19 engine and config API that Hugging Face and user scripts call: a plain
`loss.backward()` on the engine's outputs, `engine.scale`, `managed_gradient_accumulation: false`,
`coalesce_grad_reduction()`, `gradient_allreduce_op`, `unwrap_model_for_generation`, `MiCS_Init`,
`tput_timer.batch_size`, and the `DeepSpeedZeroConfig` models. The multi-rank cases run in one
world of 2 ranks and compare parameters with zeroshard's own `engine.backward` path."""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch
from torch import nn

import zeroshard
from tests.harness import run_world

GAS = 2


class _Net(nn.Module):
    """Returns its loss and the output it computed it from (as Hugging Face models do)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(5, 7)
        self.b = nn.Linear(7, 3)

    def forward(self, x, y):
        out = self.b(torch.relu(self.a(x)))
        return ((out - y) ** 2).mean(), out


def _config(stage: int, **top) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": GAS,
           "gradient_clipping": 0.0, "steps_per_print": None,
           "zero_optimization": {"stage": stage},
           "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}  # SGD: sensitive to any scale
    cfg.update(top)
    if cfg["zero_optimization"]["stage"] == 3:  # every parameter sharded
        cfg["zero_optimization"].setdefault("stage3_param_persistence_threshold", 0)
    return cfg


def _engine(config: dict):
    torch.manual_seed(0)
    model = _Net()
    return zeroshard.initialize(model=model, config=config)[0]


def _batch(rank: int, i: int):
    gen = torch.Generator().manual_seed(100 + 7 * i + rank)
    return torch.randn(2, 5, generator=gen), torch.randn(2, 3, generator=gen)


def _params(engine) -> torch.Tensor:
    params = list(engine.module.parameters())
    with zeroshard.GatheredParameters(params):
        return torch.cat([p.detach().float().flatten().clone() for p in params])


def _diff(a, b) -> float:
    return float((a - b).abs().max())


def _run(engine, micro_steps: int, how: str, offset: int = 0):
    """`micro_steps` forward/backward/step calls, the backward done `how`."""
    for i in range(micro_steps):
        loss, out = engine(*_batch(engine.rank, offset + i))
        if how == "mixed":  # a loss of both outputs: each path is divided by GAS once
            loss = loss + out.pow(2).mean()
        if how in ("engine", "mixed_engine"):
            engine.backward(loss if how == "engine" else loss + out.pow(2).mean())
        elif how == "scale":
            engine.scale(loss).backward()
        else:
            loss.backward()
        engine.step()
    return _params(engine)


def _error(fn) -> str:
    try:
        fn()
    except Exception as err:  # noqa: BLE001 - the type and message are the result
        return f"{type(err).__name__}: {err}"
    return "no error"


def _user_backward(rank: int, out: dict) -> None:
    for stage in range(4):
        ref = _run(_engine(_config(stage)), 4, "engine")
        out[f"torch-style {stage}"] = _diff(ref, _run(_engine(_config(stage)), 4, "torch"))
        out[f"scale {stage}"] = _diff(ref, _run(_engine(_config(stage)), 4, "scale"))
        out[f"mixed {stage}"] = _diff(_run(_engine(_config(stage)), 4, "mixed_engine"),
                                      _run(_engine(_config(stage)), 4, "mixed"))
        out[f"trained {stage}"] = _diff(ref, _params(_engine(_config(stage))))
        out[f"ref {stage}"] = ref
    fp16 = _config(2, fp16={"enabled": True, "initial_scale_power": 8})
    ref = _run(_engine(fp16), 4, "engine")
    out["fp16 scale"] = _diff(ref, _run(_engine(fp16), 4, "scale"))
    engine = _engine(fp16)
    loss, _ = engine(*_batch(rank, 0))
    out["fp16 plain"] = _error(loss.backward)
    # Refused before any gradient reached the model: the same engine then trains as the reference.
    out["fp16 after refusal"] = _diff(ref, _run(engine, 4, "engine"))


def _unmanaged(rank: int, out: dict) -> None:
    for stage in range(4):
        engine = _engine(_config(stage, managed_gradient_accumulation=False))
        boundaries, applied = [], []
        for step in range(2):
            for micro in range(GAS):
                loss, _ = engine(*_batch(rank, step * GAS + micro))
                engine.backward(loss)  # divided by GAS: the same as the managed reference
                boundaries.append(engine.is_gradient_accumulation_boundary())
            engine.step()
            applied.append(engine.was_step_applied())
        out[f"unmanaged {stage}"] = _diff(out[f"ref {stage}"], _params(engine))
        out[f"unmanaged flags {stage}"] = (boundaries, applied, engine.global_steps,
                                           engine.global_samples)
        out[f"unmanaged set_boundary {stage}"] = _error(
            lambda: engine.set_gradient_accumulation_boundary(True))
        if stage:
            out[f"unmanaged coalesce {stage}"] = _error(
                lambda: engine.coalesce_grad_reduction().__enter__())
    # Varying micro-batch counts, averaged by the caller, against the managed engine driven by
    # set_gradient_accumulation_boundary (DeepSpeed's own test of the feature).
    counts = [1, 3]
    for stage in (1, 3):
        unmanaged = _engine(_config(stage, managed_gradient_accumulation=False))
        managed = _engine(_config(stage))
        i = 0
        for n in counts:
            for micro in range(n):
                loss, _ = unmanaged(*_batch(rank, i))
                unmanaged.backward(loss / n, scale_wrt_gas=False)
                managed.set_gradient_accumulation_boundary(micro == n - 1)
                loss, _ = managed(*_batch(rank, i))
                managed.backward(loss / n, scale_wrt_gas=False)
                managed.step()
                i += 1
            unmanaged.step()
        out[f"varying {stage}"] = _diff(_params(managed), _params(unmanaged))
        out[f"varying samples {stage}"] = unmanaged.global_samples
    out["unmanaged overlap"] = _error(lambda: _engine(_config(
        1, managed_gradient_accumulation=False,
        zero_optimization={"stage": 1, "overlap_comm": True})))


def _coalesce(rank: int, out: dict) -> None:
    chunks = 3
    for stage in (1, 2, 3):
        runs = {}
        for coalesced in (False, True):
            engine = _engine(_config(stage, gradient_accumulation_steps=1))
            before = engine.comm_report().get("reduce_scatter", 0)
            with engine.coalesce_grad_reduction() if coalesced else contextlib.nullcontext():
                for j in range(chunks):
                    loss, _ = engine(*_batch(rank, j))
                    engine.set_gradient_accumulation_boundary(j == chunks - 1)
                    engine.backward(loss)
            moved = engine.comm_report().get("reduce_scatter", 0) - before
            engine.step()
            runs[coalesced] = (_params(engine), moved, engine.global_steps)
        out[f"coalesce {stage}"] = (_diff(runs[False][0], runs[True][0]), runs[False][1],
                                    runs[True][1], runs[True][2])
    engine = _engine(_config(2, gradient_accumulation_steps=1))
    with engine.coalesce_grad_reduction():
        out["coalesce step inside"] = _error(engine.step)
    out["coalesce stage 0"] = _error(
        lambda: _engine(_config(0)).coalesce_grad_reduction().__enter__())
    engine = _engine(_config(1))
    with engine.coalesce_grad_reduction():
        out["no_sync inside coalesce"] = _error(lambda: engine.no_sync().__enter__())
    with engine.no_sync():
        out["coalesce inside no_sync"] = _error(
            lambda: engine.coalesce_grad_reduction().__enter__())


def _allreduce_op(rank: int, out: dict) -> None:
    for stage in range(3):
        start = _params(_engine(_config(stage)))
        moves = []
        for op in ("mean", "SUM"):
            engine = _engine(_config(stage, gradient_allreduce_op=op))
            moves.append(start - _run(engine, GAS, "engine"))
        moved = moves[0].abs() > 1e-5
        ratio = moves[1][moved] / moves[0][moved]
        out[f"sum {stage}"] = (float(ratio.min()), float(ratio.max()), engine.gradient_average,
                               int(moved.sum()))
    out["sum stage 3"] = _error(lambda: _engine(_config(3, gradient_allreduce_op="sum")))


def _generation_and_mics(rank: int, out: dict) -> None:
    from zeroshard.compat.deepspeed.zero import MiCS_Init, unwrap_model_for_generation

    engine = _engine(_config(3))
    x, y = _batch(rank, 0)
    with torch.no_grad():
        expected = engine(x, y)[1]
        with unwrap_model_for_generation(engine) as unwrapped:
            before = engine.comm_report()["total"]
            got = [unwrapped(x, y)[1] for _ in range(3)]
            out["unwrap collectives"] = engine.comm_report()["total"] - before
            out["unwrap yields engine"] = unwrapped is engine
    out["unwrap values"] = max(_diff(expected, g) for g in got)
    mics = _config(3, zero_optimization={"stage": 3, "mics_shard_size": 1})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.manual_seed(0)
        with MiCS_Init(config_dict_or_path=mics):
            model = _Net()
    out["mics built whole"] = [tuple(p.shape) for p in model.parameters()]
    out["mics notice"] = [str(w.message) for w in caught if "MiCS_Init" in str(w.message)]
    engine = zeroshard.initialize(model=model, config=mics)[0]
    out["mics vs stage 3"] = _diff(out["ref 3"], _run(engine, 4, "engine"))
    out["mics without key"] = _error(lambda: MiCS_Init(config_dict_or_path=_config(3)))
    out["tput batch_size"] = (engine.tput_timer.batch_size, engine.train_batch_size())


def _world(rank: int, world: int) -> dict:
    out: dict = {}
    for case in (_user_backward, _unmanaged, _coalesce, _allreduce_op, _generation_and_mics):
        case(rank, out)
    return {k: v for k, v in out.items() if not k.startswith("ref ")}


@pytest.fixture(scope="module")
def world():
    return run_world(2, _world)


def test_plain_backward_equals_engine_backward_at_every_stage(world):
    for r in world:
        for stage in range(4):
            assert r[f"trained {stage}"] > 1e-3  # the reference trained
            assert r[f"torch-style {stage}"] < 1e-6, stage
            assert r[f"scale {stage}"] < 1e-6, stage
            # loss and logits both returned and both in the loss: divided by GAS once per path
            assert r[f"mixed {stage}"] < 1e-6, stage


def test_fp16_plain_backward_needs_scale(world):
    for r in world:
        assert r["fp16 scale"] < 1e-3
        assert r["fp16 plain"].startswith("RuntimeError: loss.backward() under fp16 loss scaling")
        assert "engine.scale(loss).backward()" in r["fp16 plain"]
        assert r["fp16 after refusal"] < 1e-3


def test_unmanaged_accumulation(world):
    for r in world:
        for stage in range(4):
            assert r[f"unmanaged {stage}"] < 1e-6, stage
            boundaries, applied, steps, samples = r[f"unmanaged flags {stage}"]
            assert boundaries == [False] * 4 and applied == [True, True] and steps == 2
            assert samples == 2 * GAS * 2 * 2  # steps x backwards x micro batch x world
            assert "managed_gradient_accumulation=false" in r[f"unmanaged set_boundary {stage}"]
            if stage:
                assert r[f"unmanaged coalesce {stage}"].startswith("RuntimeError")
        for stage in (1, 3):
            assert r[f"varying {stage}"] < 1e-6
            assert r[f"varying samples {stage}"] == (1 + 3) * 2 * 2
        assert "overlap_comm=true at stage 1" in r["unmanaged overlap"]


def test_coalesce_grad_reduction(world):
    for r in world:
        for stage in (1, 2, 3):
            diff, plain, coalesced, steps = r[f"coalesce {stage}"]
            assert diff < 1e-6 and steps == 1, stage
            if stage == 1:  # reduced at the step either way
                assert plain == coalesced == 0
            else:  # one reduce-scatter per unit for the three backwards, not three
                assert plain == 3 * coalesced > 0, stage
        assert "inside engine.no_sync() or engine.coalesce_grad_reduction()" in \
            r["coalesce step inside"]
        assert r["coalesce stage 0"].startswith("NotImplementedError")
        assert r["no_sync inside coalesce"].startswith("RuntimeError")
        assert r["coalesce inside no_sync"].startswith("RuntimeError")


def test_gradient_allreduce_op_sum(world):
    for r in world:
        for stage in range(3):
            low, high, average, compared = r[f"sum {stage}"]
            assert compared > 40 and abs(low - 2) < 1e-3 and abs(high - 2) < 1e-3, stage  # 2 ranks
            assert average is False
        assert "not supported with ZeRO stage 3" in r["sum stage 3"]


def test_unwrap_for_generation_mics_init_and_timer(world):
    for r in world:
        assert r["unwrap collectives"] == 0 and r["unwrap yields engine"]
        assert r["unwrap values"] < 1e-6
        assert r["mics built whole"] == [(7, 5), (7,), (3, 7), (3,)]
        assert len(r["mics notice"]) == 1
        assert r["mics vs stage 3"] < 1e-5
        assert "mics_shard_size > 0" in r["mics without key"]
        assert r["tput batch_size"] == (2 * GAS * 2, 2 * GAS * 2)


# -- single process: the config models and the sanity-check key ---------------------------------

def test_deepspeed_zero_config_models():
    from zeroshard.compat.deepspeed.zero_config import (DeepSpeedZeroConfig,
                                                        DeepSpeedZeroOffloadOptimizerConfig,
                                                        DeepSpeedZeroOffloadParamConfig,
                                                        OffloadDeviceEnum, ZeroStageEnum,
                                                        get_zero_config)

    block = {"stage": 3, "offload_optimizer": {"device": "cpu"},
             "offload_param": {"device": "nvme", "nvme_path": "/local"},
             "stage3_prefetch_bucket_size": "auto", "stage3_param_persistence_threshold": 77,
             "stage3_gather_16bit_weights_on_model_save": True}
    cfg = DeepSpeedZeroConfig(**block)
    assert cfg.stage == ZeroStageEnum.weights and type(cfg.stage) is int
    assert cfg.offload_optimizer.device == OffloadDeviceEnum.cpu == "cpu"
    assert isinstance(cfg.offload_param, DeepSpeedZeroOffloadParamConfig)
    assert str(cfg.offload_param.nvme_path) == "/local" and cfg.offload_param.buffer_count == 5
    assert cfg.param_persistence_threshold == 77 and cfg.gather_16bit_weights_on_model_save
    assert cfg.prefetch_bucket_size == 50_000_000  # "auto" left out: the default
    assert cfg.overlap_comm is True and DeepSpeedZeroConfig(stage=2).overlap_comm is False
    assert cfg.enable_sanity_checks is False and cfg.use_multi_rank_bucket_allreduce is True
    assert DeepSpeedZeroConfig(prefetch_bucket_size=5).prefetch_bucket_size == 5
    assert DeepSpeedZeroConfig(cpu_offload=True).offload_optimizer.device == "cpu"
    assert DeepSpeedZeroConfig(legacy_stage1=True).legacy_stage1 is True
    nested = DeepSpeedZeroConfig(stage=3, offload_optimizer=DeepSpeedZeroOffloadOptimizerConfig(
        device="cpu", pipeline_read=True))
    assert nested.offload_optimizer.pipeline and nested.offload_optimizer.ratio == 1.0
    assert get_zero_config({"zero_optimization": True}).stage == 1
    for bad, says in (({"stage": 5}, "zero_optimization.stage = 5"),
                      ({"stagee": 1}, "did you mean 'stage'"),
                      ({"offload_optimizer": {"device": "gpu"}}, "offload_optimizer.device"),
                      ({"stage": "auto"}, "'auto'")):
        with pytest.raises(ValueError, match=says):
            DeepSpeedZeroConfig(strict="auto" in bad.values(), **bad)


def test_deepspeed_module_paths_answer():
    from zeroshard.compat.deepspeed import alias, zero, zero_config

    for path, target in (("deepspeed.runtime.zero.config", zero_config),
                         ("deepspeed.runtime.zero.offload_config", zero_config),
                         ("deepspeed.runtime.zero.stage3", zero),
                         ("deepspeed.runtime.zero", zero)):
        assert alias.ALIASES[path] == target.__name__
    for name in ("MiCS_Init", "unwrap_model_for_generation"):
        assert name in zero.__all__
    # DeepSpeed's tests and scripts catch a bad config as deepspeed.DeepSpeedConfigError.
    from zeroshard.config.schema import ConfigError, load_config

    module, name = alias.RENAMED["deepspeed"]["DeepSpeedConfigError"]
    error = getattr(__import__(module, fromlist=[name]), name)
    assert error is ConfigError and issubclass(error, Exception)
    with pytest.raises(error, match="stage"):
        load_config({"zero_optimization": {"stage": 7}})


def test_git_version_info_reads_as_an_unbuilt_deepspeed():
    """DeepSpeed's test helpers (bf16_required_version_check) and environment reports index
    `torch_info` and `installed_ops`: "0.0" means "ask torch at run time", no op is pre-built."""
    from zeroshard.compat.deepspeed import alias, git_version_info as info

    assert alias.ALIASES["deepspeed.git_version_info"] == info.__name__
    assert info.version == alias.DEEPSPEED_VERSION
    assert {info.torch_info[k] for k in ("version", "cuda_version", "nccl_version",
                                         "hip_version")} == {"0.0"}
    assert info.torch_info["bf16_support"] is False
    assert info.installed_ops["cpu_adam"] is False and set(info.installed_ops) >= {"async_io"}
    assert info.accelerator_name == ("cuda" if torch.cuda.is_available() else "cpu")


def test_enable_sanity_checks_is_accepted():
    from zeroshard.config.schema import ConfigWarning, load_config

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = load_config({"zero_optimization": {"stage": 3, "enable_sanity_checks": False}})
        load_config({"zero_optimization": {"stage": 3, "enable_sanity_checks": True}})
        load_config({"zero_optimization": {"stage": 2, "enable_sanity_checks": True}})
    notices = [str(w.message) for w in caught if issubclass(w.category, ConfigWarning)
               and "enable_sanity_checks" in str(w.message)]
    # It acts at stage 3 (tests/test_deepspeed_zero_init.py); below, a notice says it does not.
    assert len(notices) == 1 and "no effect below ZeRO stage 3" in notices[0]
    assert load_config(cfg.to_dict()).zero_optimization.enable_sanity_checks is False
    for op in ("Mean", "sum"):
        assert load_config({"gradient_allreduce_op": op}).gradient_allreduce_op == op.lower()
    with pytest.raises(ValueError, match="gradient_allreduce_op"):
        load_config({"gradient_allreduce_op": "max"})


def test_op_builder_names_say_which_ops_are_answered():
    """`deepspeed.ops.__compatible_ops__[Builder.NAME]` (DeepSpeed's tests and scripts ask it
    before using an op): True for the optimizers and NVMe I/O zeroshard answers, False for the
    rest and for a name nobody knows; `load()` refuses naming the replacement."""
    from zeroshard.compat.deepspeed import alias, ops
    from zeroshard.compat.deepspeed.ops import op_builder as ob

    assert alias.ALIASES["deepspeed.ops.op_builder"] == ob.__name__
    compatible = ops.__compatible_ops__
    for builder in (ob.CPUAdamBuilder, ob.FusedAdamBuilder, ob.CPUAdagradBuilder,
                    ob.CPULionBuilder, ob.FusedLionBuilder, ob.AsyncIOBuilder):
        assert compatible[builder.NAME] and builder().is_compatible(), builder.__name__
    assert not compatible[ob.FusedLambBuilder.NAME] and not ob.FusedLambBuilder().is_compatible()
    assert compatible["no_such_op"] is False
    with pytest.raises(NotImplementedError, match="DeepSpeedCPUAdam"):
        ob.CPUAdamBuilder().load()


def test_ignore_unused_parameters_false_says_it_has_no_effect():
    """DeepSpeed stops on unused parameters under `ignore_unused_parameters: false`; zeroshard
    treats them as zero gradients, so that setting warns once, and the default stays quiet."""
    from zeroshard.config.schema import ConfigWarning, load_config

    def notices(value):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            cfg = load_config({"zero_optimization": {"stage": 2,
                                                     "ignore_unused_parameters": value}})
        assert cfg.zero_optimization.ignore_unused_parameters is value
        return [str(w.message) for w in caught if issubclass(w.category, ConfigWarning)
                and "ignore_unused_parameters" in str(w.message)]

    assert notices(True) == []
    assert len(notices(False)) == 1 and "has no effect" in notices(False)[0]


def test_required_torch_version_and_moe_groups_answer():
    """deepspeed.utils.torch.required_torch_version bounds the installed torch as DeepSpeed's does;
    deepspeed.moe.utils' splitter hands a model without experts its groups back as lists."""
    import importlib

    from zeroshard.compat.deepspeed import alias

    def target(path):
        return importlib.import_module(alias.ALIASES[path])

    check = target("deepspeed.utils.torch").required_torch_version
    major, minor = (int(x) for x in torch.__version__.split(".")[:2])
    assert check(min_version=1.4) and check(min_version=f"{major}.{minor}")
    assert not check(min_version=f"{major + 1}.0") and not check(max_version=1.4)
    assert check(min_version="1.0", max_version=f"{major + 1}")
    with pytest.raises(ValueError, match="min_version, max_version or both"):
        check()
    split = target("deepspeed.moe.utils").split_params_into_different_moe_groups_for_optimizer
    layer = torch.nn.Linear(2, 2)
    groups = split({"params": (p for p in layer.parameters()), "lr": 0.1})
    assert groups == [{"params": list(layer.parameters()), "lr": 0.1}]
    assert split(({"params": [layer.weight]}, {"params": [layer.bias]})) == \
        [{"params": [layer.weight]}, {"params": [layer.bias]}]
