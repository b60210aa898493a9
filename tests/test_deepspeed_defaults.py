"""zeroshard's config defaults equal DeepSpeed 0.19.8's, key by key.

`tests/fixtures/deepspeed_defaults.json` records what real DeepSpeed chose for every key of the
sections zeroshard models (written by bench/conformance/record_defaults.py from DeepSpeed's own
config objects). Every field of zeroshard's schema with a default is either equal to it or listed
below with the reason; a listed key that has become equal, or that no longer exists, fails too.
"""

import json
import os

import pytest

from zeroshard.config.schema import _SCHEMA, load_config

with open(os.path.join(os.path.dirname(__file__), "fixtures", "deepspeed_defaults.json"),
          encoding="utf-8") as _fh:
    DEEPSPEED = json.load(_fh)

#: Keys zeroshard accepts that DeepSpeed 0.19.8 does not have (or reads through other code).
ZEROSHARD_ONLY = {
    "seed": "the engine's RNG seed (zeroshard; DeepSpeed scripts seed themselves)",
    "zero_optimization.mics_shard_size": "MiCS, which DeepSpeed 0.19 removed (it refuses the key)",
    "zero_optimization.zeroshard_unit_classes": "zeroshard's stage-3 unit choice",
    "zero_optimization.zeroshard_desync_timeout": "zeroshard's desync watchdog",
    "zero_optimization.offload_optimizer.zeroshard_step_in_backward": "zeroshard's early step",
    "aio.thread_count": "older DeepSpeed releases' key; 0.19 no longer reads it",
}

#: Keys whose default differs on purpose, with the reason (docs/migrating-from-deepspeed.md).
DIFFERENT = {
    "zero_optimization.overlap_comm": "None: DeepSpeed overlaps at stage 3 only; zeroshard "
                                      "overlaps at every stage unless false is written (a "
                                      "schedule, no effect on the numbers): checked below",
}

#: Batch sizes, the optimizer and scheduler blocks have no default: the config decides.
NO_DEFAULT = {"train_batch_size", "train_micro_batch_size_per_gpu",
              "gradient_accumulation_steps", "optimizer", "scheduler"}


def _fields():
    for path, cls in _SCHEMA.items():
        for name, field in cls.model_fields.items():
            if field.is_required():
                continue
            default = field.get_default(call_default_factory=True)
            if hasattr(default, "model_dump"):
                continue  # a nested section: its own keys are compared
            yield path, name, default


def _full(path, name):
    return f"{path}.{name}" if path else name


FIELDS = list(_fields())


@pytest.mark.parametrize("path,name,default", FIELDS, ids=[_full(p, n) for p, n, _ in FIELDS])
def test_default_equals_deepspeed(path, name, default):
    full = _full(path, name)
    if full in NO_DEFAULT or path in ("optimizer", "scheduler"):
        assert default is None or path in ("optimizer", "scheduler")
        return
    section = DEEPSPEED.get(path)
    assert section is not None, f"no DeepSpeed section recorded for '{path}'"
    if full in ZEROSHARD_ONLY:
        assert name not in section, f"{full} is listed as zeroshard-only but DeepSpeed has it"
        return
    assert name in section, (f"{full} is not a DeepSpeed 0.19.8 key: list it in ZEROSHARD_ONLY "
                             "with the reason")
    if full in DIFFERENT:
        assert default != section[name], f"{full} now equals DeepSpeed's; drop it from the list"
        return
    assert default == section[name], (f"{full}: zeroshard's default {default!r}, DeepSpeed "
                                      f"0.19.8's {section[name]!r}")


def test_every_listed_exception_is_a_field():
    keys = {_full(p, n) for p, n, _ in FIELDS}
    assert set(ZEROSHARD_ONLY) <= keys and set(DIFFERENT) <= keys


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_overlap_comm_unset_overlaps_at_every_stage(stage):
    from zeroshard.build import _stage_spec

    on = load_config({"train_batch_size": 1, "zero_optimization": {"stage": stage}})
    assert on.zero_optimization.overlap_comm is None
    assert DEEPSPEED["zero_optimization"]["overlap_comm"] is False
    off = load_config({"train_batch_size": 1,
                       "zero_optimization": {"stage": stage, "overlap_comm": False}})
    assert _stage_spec(off, _Placement(), [], None, None).overlap_comm is False
    assert _stage_spec(on, _Placement(), [], None, None).overlap_comm is True


class _Placement:
    """What _stage_spec reads of a placement."""
    name = "device"
    master_dtype = None


def test_the_defaults_that_changed_in_deepspeed_0_19_are_deepspeeds():
    """The four defaults DeepSpeed changed lately (docs/migrating-from-deepspeed.md lists them)."""
    cfg = load_config({"train_micro_batch_size_per_gpu": 1})
    assert cfg.gradient_clipping == 1.0  # 0.19.3 (was 0: no clipping)
    assert cfg.bf16.check_grad_overflow is True  # 0.19.3 (new key)
    zero = load_config({"train_batch_size": 1, "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"},
                                              "offload_param": {"device": "cpu"}}}).zero_optimization
    assert zero.offload_optimizer.pin_memory and zero.offload_param.pin_memory  # 0.19.5
    assert cfg.steps_per_print is None  # 0.15.2 (was 10)
