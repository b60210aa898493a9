"""Tests for zeroshard.schedulers against closed-form DeepSpeed schedule formulas.

Convention under test: constructing with last_batch_iteration=-1 writes the start value; the k-th
call to step() (k >= 1) applies the formula at iteration t = k - 1.
"""
import math

import pytest
import torch

from zeroshard.schedulers import (LRRangeTest, OneCycle, SCHEDULERS, WarmupCosineLR, WarmupDecayLR,
                                  WarmupLR, build_scheduler)

APPROX = dict(rel=1e-12, abs=1e-15)


def sgd(lrs=(0.1, 0.01), momentum=0.0):
    """Real SGD optimizer with one param group per entry of ``lrs``."""
    groups = [{"params": [torch.nn.Parameter(torch.zeros(2))], "lr": lr} for lr in lrs]
    return torch.optim.SGD(groups, lr=lrs[0], momentum=momentum)


def adam(lrs=(0.1, 0.01)):
    """Real Adam optimizer with one param group per entry of ``lrs``."""
    groups = [{"params": [torch.nn.Parameter(torch.zeros(2))], "lr": lr} for lr in lrs]
    return torch.optim.Adam(groups, lr=lrs[0])


def lrs_of(opt):
    """Current lr of every param group."""
    return [g["lr"] for g in opt.param_groups]


def run(sched, opt, n):
    """Step ``n`` times, returning the list of per-group lrs after each step."""
    out = []
    for _ in range(n):
        sched.step()
        out.append(lrs_of(opt))
        assert sched.get_last_lr() == out[-1]
    return out


# ---- independent closed forms --------------------------------------------------------------------

def warm_frac(t, num_steps, kind):
    w = max(2, num_steps)
    if t >= w:
        return 1.0
    return math.log(t + 1) / math.log(w) if kind == "log" else t / w


def expected_warmup(t, lo, hi, num_steps, kind):
    return lo + (hi - lo) * warm_frac(t, num_steps, kind)


def expected_decay(t, lo, hi, num_steps, total, kind):
    w = max(2, num_steps)
    if t < w:
        return expected_warmup(t, lo, hi, num_steps, kind)
    return lo + (hi - lo) * max(0.0, (total - t) / max(1.0, total - w))


def expected_cosine_ratio(t, total, wmin, num_steps, cmin, kind):
    w = max(2, num_steps)
    if t < w:
        return wmin + (1 - wmin) * warm_frac(t, num_steps, kind)
    progress = min(1.0, (t - w + 1) / max(1, total - w))
    return max(0.0, cmin + (1 - cmin) * 0.5 * (1 + math.cos(math.pi * progress)))


def expected_onecycle(t, lo, hi, mlo, mhi, first, second, lr_rate, mom_rate, decay_size, stairs=(0, 0)):
    """(lr, momentum) at iteration t; the cycle shape is evaluated at b = t + 1."""
    total = first + second
    b = t + 1
    if t < total:
        pos = b % total
        s = pos / first if pos <= first else (total - pos) / second
        n = stairs[0] if pos <= first else stairs[1]
        if n > 0:
            s = math.floor(s * n + 1e-9) / n
        return lo + (hi - lo) * s, mhi - (mhi - mlo) * s
    d = b - total
    lr = lo if (decay_size == 0 or lr_rate == 0) else lo / (1 + lr_rate * d / decay_size)
    mom = mhi if (decay_size == 0 or mom_rate == 0) else mhi * (1 + mom_rate * d / decay_size)
    return lr, mom


def expected_range(t, lo, size, rate, staircase):
    x = (t + 1) / size
    return lo * (1 + rate * (math.floor(x) if staircase else x))


# ---- WarmupLR / WarmupDecayLR ----------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["log", "linear"])
def test_warmup_lr_sequence_two_groups(kind):
    opt = sgd()
    lo, hi, w = [0.0, 1e-4], [1e-2, 1e-3], 10
    s = WarmupLR(opt, warmup_min_lr=lo, warmup_max_lr=hi, warmup_num_steps=w, warmup_type=kind)
    assert lrs_of(opt) == lo  # construction writes warmup_min_lr
    assert s.get_last_lr() == lo
    seq = run(s, opt, 15)
    for k, got in enumerate(seq):
        want = [expected_warmup(k, lo[i], hi[i], w, kind) for i in range(2)]
        assert got == pytest.approx(want, **APPROX)
    assert seq[0] == pytest.approx(lo)  # t = 0: log(1) = 0 and 0 / W = 0
    peak = w - 1 if kind == "log" else w
    assert seq[peak] == pytest.approx(hi) and seq[peak - 1][0] < hi[0]
    assert seq[-1] == pytest.approx(hi)


def test_warmup_lr_defaults_and_tiny_warmup():
    opt = sgd((0.5,))
    s = WarmupLR(opt)  # warmup_max_lr defaults to each group's own lr (DeepSpeed 0.19.8)
    assert (s.min_lrs, s.max_lrs, s.warmup_num_steps, s.warmup_type) == ([0.0], [0.5], 1000, "log")
    assert WarmupDecayLR(sgd((0.5,)), total_num_steps=5000).max_lrs == [0.001]
    s2 = WarmupLR(sgd((0.5,)), warmup_num_steps=1)  # effective warmup is max(2, W)
    assert s2.warmup_num_steps == 2
    # HF's default warmup is 0 steps: DeepSpeed accepts it as W = 2, and so do we.
    assert WarmupLR(sgd((0.5,)), warmup_num_steps=0).warmup_num_steps == 2
    opt3 = sgd((0.5,))
    seq = run(WarmupLR(opt3, warmup_min_lr=0.1, warmup_max_lr=0.2, warmup_num_steps=1), opt3, 3)
    assert [x[0] for x in seq] == pytest.approx([0.1, 0.1 + 0.1 * math.log(2) / math.log(2), 0.2])


@pytest.mark.parametrize("kind", ["log", "linear"])
def test_warmup_decay_sequence(kind):
    opt = sgd()
    lo, hi, w, total = 1e-5, 1e-2, 5, 20
    s = WarmupDecayLR(opt, total_num_steps=total, warmup_min_lr=lo, warmup_max_lr=hi,
                      warmup_num_steps=w, warmup_type=kind)
    assert lrs_of(opt) == [lo, lo]
    seq = run(s, opt, 26)
    for t, got in enumerate(seq):
        assert got == pytest.approx([expected_decay(t, lo, hi, w, total, kind)] * 2, **APPROX)
    assert seq[w][0] == pytest.approx(hi)  # first decay iteration is still the peak
    assert seq[total][0] == pytest.approx(lo)  # gamma reaches 0 at t = total_num_steps
    assert all(x[0] == pytest.approx(lo) for x in seq[total:])  # clamped after total


# ---- WarmupCosineLR ----------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["log", "linear"])
def test_warmup_cosine_scales_initial_lrs(kind):
    base = [0.1, 0.02]
    opt = adam(base)
    total, wmin, w, cmin = 30, 0.1, 8, 0.05
    s = WarmupCosineLR(opt, total_num_steps=total, warmup_min_ratio=wmin, warmup_num_steps=w,
                       cos_min_ratio=cmin, warmup_type=kind)
    assert lrs_of(opt) == [0.0, 0.0]  # DeepSpeed starts at 0 before the first step()
    seq = run(s, opt, 40)
    for t, got in enumerate(seq):
        r = expected_cosine_ratio(t, total, wmin, w, cmin, kind)
        assert got == pytest.approx([base[0] * r, base[1] * r], **APPROX)
    assert seq[0][0] == pytest.approx(base[0] * wmin)
    assert seq[total - 1][0] == pytest.approx(base[0] * cmin)  # minimum at t = total - 1
    assert all(x == pytest.approx([b * cmin for b in base]) for x in seq[total - 1:])  # held at the floor


def test_warmup_cosine_no_decay_window():
    opt = sgd((0.2,))
    s = WarmupCosineLR(opt, total_num_steps=4, warmup_num_steps=4, cos_min_ratio=0.1, warmup_type="linear")
    seq = [x[0] for x in run(s, opt, 7)]
    assert seq == pytest.approx([0.0, 0.05, 0.1, 0.15, 0.02, 0.02, 0.02])


def test_warmup_cosine_defaults():
    s = WarmupCosineLR(sgd(), total_num_steps=5000)
    assert (s.warmup_min_ratio, s.warmup_num_steps, s.cos_min_ratio, s.warmup_type) == (0.0, 1000, 1e-4, "log")
    assert s.org_lrs == [0.1, 0.01]


# ---- OneCycle ----------------------------------------------------------------------------------------

def test_onecycle_adam_lr_and_betas():
    opt = adam()
    p = dict(cycle_min_lr=0.01, cycle_max_lr=0.1, decay_lr_rate=0.5, cycle_first_step_size=4,
             cycle_second_step_size=6, decay_step_size=2, cycle_min_mom=0.85, cycle_max_mom=0.95,
             decay_mom_rate=0.1)
    s = OneCycle(opt, **p)
    assert lrs_of(opt) == [0.01, 0.01]
    assert [g["betas"] for g in opt.param_groups] == [(0.85, 0.99)] * 2
    for t in range(20):
        s.step()
        lr, mom = expected_onecycle(t, 0.01, 0.1, 0.85, 0.95, 4, 6, 0.5, 0.1, 2)
        assert lrs_of(opt) == pytest.approx([lr, lr], **APPROX)
        for g in opt.param_groups:
            assert g["betas"][0] == pytest.approx(mom, **APPROX) and g["betas"][1] == 0.99
    opt.param_groups[0]["params"][0].grad = torch.ones(2)
    opt.step()  # torch accepts the betas the scheduler wrote


def test_onecycle_peak_trough_and_no_decay():
    opt = adam((0.3,))
    s = OneCycle(opt, cycle_min_lr=0.01, cycle_max_lr=0.1, cycle_first_step_size=5)
    seq = [x[0] for x in run(s, opt, 15)]
    assert seq[4] == pytest.approx(0.1) and max(seq) == seq[4]  # peak where b = t + 1 = first_step_size
    assert seq[9] == pytest.approx(0.01)  # end of cycle (b = 10)
    assert seq[10:] == [0.01] * 5  # decay_step_size=0 -> held at cycle_min_lr
    assert opt.param_groups[0]["betas"] == (0.9, 0.99)  # held at cycle_max_mom


def test_onecycle_sgd_momentum_and_plain_object():
    opt = sgd(momentum=0.5)
    s = OneCycle(opt, cycle_min_lr=0.01, cycle_max_lr=0.1, cycle_first_step_size=2)
    assert s.momentum_key == "momentum" and [g["momentum"] for g in opt.param_groups] == [0.8, 0.8]
    s.step()
    lr, mom = expected_onecycle(0, 0.01, 0.1, 0.8, 0.9, 2, 2, 0, 0, 0)
    assert lrs_of(opt) == pytest.approx([lr] * 2) and opt.param_groups[0]["momentum"] == pytest.approx(mom)

    class Plain:
        param_groups = [{"lr": 1.0}]

    plain = Plain()
    s2 = OneCycle(plain, cycle_min_lr=0.01, cycle_max_lr=0.1, cycle_first_step_size=2)
    assert not s2.cycle_momentum and s2.get_mom() is None
    s2.step()
    assert plain.param_groups == [{"lr": pytest.approx(0.055)}]


@pytest.mark.parametrize("first,second,stairs", [(6, 6, (3, 3)), (4, 8, (2, 4)), (5, 3, (5, None))])
def test_onecycle_staircase(first, second, stairs):
    opt = adam((0.3,))
    s = OneCycle(opt, cycle_min_lr=0.0, cycle_max_lr=1.0, cycle_first_step_size=first,
                 cycle_second_step_size=second, cycle_first_stair_count=stairs[0],
                 cycle_second_stair_count=stairs[1], cycle_min_mom=0.8, cycle_max_mom=0.9)
    n = (stairs[0], stairs[0] if stairs[1] is None else stairs[1])
    for t in range(first + second + 2):
        s.step()
        lr, mom = expected_onecycle(t, 0.0, 1.0, 0.8, 0.9, first, second, 0, 0, 0, stairs=n)
        assert opt.param_groups[0]["lr"] == pytest.approx(lr, abs=1e-12)
        assert opt.param_groups[0]["betas"][0] == pytest.approx(mom, abs=1e-12)


def test_onecycle_defaults():
    s = OneCycle(adam(), cycle_min_lr=0.001, cycle_max_lr=0.01)
    assert s.total_size == 4000 and s.step_ratio == 0.5 and s.decay_step_size == 0
    assert (s.min_moms, s.max_moms, s.cycle_momentum) == ([0.8, 0.8], [0.9, 0.9], True)
    assert s.second_stair_count == 0


# ---- LRRangeTest -------------------------------------------------------------------------------------

@pytest.mark.parametrize("staircase", [False, True])
def test_lr_range_test(staircase):
    opt = sgd()
    lo = [1e-4, 2e-4]
    s = LRRangeTest(opt, lr_range_test_min_lr=lo, lr_range_test_step_size=3,
                    lr_range_test_step_rate=2.0, lr_range_test_staircase=staircase)
    assert lrs_of(opt) == lo
    for t, got in enumerate(run(s, opt, 12)):
        assert got == pytest.approx([expected_range(t, x, 3, 2.0, staircase) for x in lo], **APPROX)


def test_lr_range_defaults():
    s = LRRangeTest(sgd())
    assert (s.min_lr, s.step_size, s.step_rate, s.staircase) == ([1e-3, 1e-3], 2000, 1.0, False)


# ---- shared behaviour --------------------------------------------------------------------------------

SPECS = [
    ("WarmupLR", dict(warmup_min_lr=0.001, warmup_max_lr=0.01, warmup_num_steps=6), sgd),
    ("WarmupLR", dict(warmup_num_steps=5, warmup_type="linear"), adam),
    ("WarmupDecayLR", dict(total_num_steps=12, warmup_num_steps=4, warmup_type="linear"), sgd),
    ("WarmupCosineLR", dict(total_num_steps=12, warmup_num_steps=4, warmup_min_ratio=0.2), adam),
    ("OneCycle", dict(cycle_min_lr=0.01, cycle_max_lr=0.1, cycle_first_step_size=3, decay_lr_rate=0.3,
                      decay_step_size=2, decay_mom_rate=0.05), adam),
    ("OneCycle", dict(cycle_min_lr=[0.01, 0.02], cycle_max_lr=[0.1, 0.3], cycle_first_step_size=4,
                      cycle_second_step_size=6, cycle_first_stair_count=2, cycle_second_stair_count=3), adam),
    ("LRRangeTest", dict(lr_range_test_step_size=4, lr_range_test_staircase=True), sgd),
]


@pytest.mark.parametrize("name,params,make", SPECS, ids=[f"{s[0]}-{i}" for i, s in enumerate(SPECS)])
def test_state_dict_resume_identical(name, params, make):
    opt = make()
    ref_sched = build_scheduler({"type": name, "params": params}, opt)
    reference = run(ref_sched, opt, 16)
    ref_betas = [g.get("betas") for g in opt.param_groups]

    opt_a = make()
    a = build_scheduler({"type": name, "params": params}, opt_a)
    first = run(a, opt_a, 7)
    sd = a.state_dict()
    assert sd == {"last_batch_iteration": 6}
    opt_b = make()
    b = build_scheduler({"type": name.lower(), "params": params}, opt_b)
    b.load_state_dict(sd)
    assert first + run(b, opt_b, 9) == reference
    assert [g.get("betas") for g in opt_b.param_groups] == ref_betas


@pytest.mark.parametrize("name,params,make", SPECS, ids=[f"{s[0]}-{i}" for i, s in enumerate(SPECS)])
def test_explicit_iteration_and_resume_ctor(name, params, make):
    opt = make()
    s = build_scheduler({"type": name, "params": params}, opt)
    seq = run(s, opt, 10)
    s.step(3)
    assert s.last_batch_iteration == 3 and lrs_of(opt) == seq[3]
    opt2 = make()
    before = lrs_of(opt2)
    r = SCHEDULERS[name](opt2, last_batch_iteration=5, **params)  # resumed: groups untouched
    assert lrs_of(opt2) == before and r.get_last_lr() == before
    r.step()
    assert lrs_of(opt2) == seq[6]


def test_wrapper_exposing_param_groups():
    inner = sgd()

    class Wrapper:
        @property
        def param_groups(self):
            return inner.param_groups

    s = WarmupLR(Wrapper(), warmup_min_lr=0.0, warmup_max_lr=1.0, warmup_num_steps=4, warmup_type="linear")
    s.step()
    s.step()
    assert lrs_of(inner) == [0.25, 0.25]


def test_tensor_lr_updated_in_place():
    p = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.Adam([p], lr=torch.tensor(0.01))
    lr_tensor = opt.param_groups[0]["lr"]
    s = WarmupCosineLR(opt, total_num_steps=10, warmup_num_steps=2, warmup_type="linear")
    assert opt.param_groups[0]["lr"] is lr_tensor and float(lr_tensor) == 0.0
    s.step()
    s.step()
    assert opt.param_groups[0]["lr"] is lr_tensor and float(lr_tensor) == pytest.approx(0.005)


def test_build_scheduler_types():
    opt = sgd()
    s = build_scheduler({"type": "warmupdecaylr", "params": {"total_num_steps": 5000}}, opt)
    assert type(s) is WarmupDecayLR and s.total_num_steps == 5000
    assert type(build_scheduler({"type": "WarmupLR"}, opt)) is WarmupLR


# ---- validation --------------------------------------------------------------------------------------

@pytest.mark.parametrize("call,words", [
    (lambda o: WarmupLR(o, warmup_type="cosine"), ["WarmupLR", "warmup_type"]),
    (lambda o: WarmupCosineLR(o, total_num_steps=10, warmup_type="exp"), ["WarmupCosineLR", "warmup_type"]),
    (lambda o: WarmupDecayLR(o, total_num_steps=10, warmup_num_steps=50), ["WarmupDecayLR", "total_num_steps"]),
    (lambda o: WarmupCosineLR(o, total_num_steps=40, warmup_num_steps=50), ["WarmupCosineLR", "total_num_steps"]),
    (lambda o: WarmupLR(o, warmup_num_steps=-3), ["WarmupLR", "warmup_num_steps"]),
    (lambda o: WarmupCosineLR(o, 100, warmup_num_steps=2.5), ["WarmupCosineLR", "warmup_num_steps"]),
    (lambda o: OneCycle(o, 0.1, 1.0, cycle_second_step_size=-1), ["OneCycle", "cycle_second_step_size"]),
    (lambda o: OneCycle(o, [0.1], 1.0), ["OneCycle", "cycle_min_lr"]),
    (lambda o: WarmupLR(o, warmup_max_lr=[0.1, 0.2, 0.3]), ["WarmupLR", "warmup_max_lr"]),
    (lambda o: WarmupLR(o, warmup_max_rl=0.1), ["WarmupLR", "warmup_max_rl", "did you mean 'warmup_max_lr'"]),
    (lambda o: OneCycle(o, 0.1, 1.0, cycle_first_step_size=0), ["OneCycle", "cycle_first_step_size"]),
    (lambda o: OneCycle(o, 0.1, 1.0, cycle_momentun=False), ["OneCycle", "did you mean 'cycle_momentum'"]),
    (lambda o: LRRangeTest(o, lr_range_test_step_size=0), ["LRRangeTest", "lr_range_test_step_size"]),
    (lambda o: LRRangeTest(o, step_size=10), ["LRRangeTest", "'step_size'", "lr_range_test_step_size"]),
    (lambda o: build_scheduler({"type": "WarmpLR", "params": {}}, o), ["WarmpLR", "did you mean 'WarmupLR'"]),
    (lambda o: build_scheduler({"type": "Foo"}, o), ["unknown scheduler type 'Foo'"]),
    (lambda o: build_scheduler({"params": {}}, o), ["'type'"]),
    (lambda o: build_scheduler({"type": "OneCycle", "params": {"cycle_min_lr": 0.1}}, o),
     ["OneCycle", "cycle_max_lr"]),
    (lambda o: build_scheduler({"type": "WarmupCosineLR", "params": {}}, o), ["WarmupCosineLR", "total_num_steps"]),
])
def test_bad_params_raise(call, words):
    opt = sgd()
    before = lrs_of(opt)
    with pytest.raises(ValueError) as info:
        call(opt)
    for w in words:
        assert w in str(info.value)
    assert lrs_of(opt) == before  # nothing written on failure


def test_non_optimizer_rejected():
    with pytest.raises(TypeError):
        WarmupLR(object())


# ---- optional cross-check against DeepSpeed ----------------------------------------------------------

@pytest.mark.parametrize("name,params,make", SPECS, ids=[f"{s[0]}-{i}" for i, s in enumerate(SPECS)])
def test_matches_deepspeed_if_available(name, params, make, monkeypatch):
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    try:
        from deepspeed.runtime import lr_schedules as ds
    except Exception as exc:  # not installed, or unusable on this machine
        pytest.skip(f"deepspeed unavailable: {exc}")
    ours_opt, ds_opt = make(), make()
    ours = build_scheduler({"type": name, "params": params}, ours_opt)
    theirs = getattr(ds, name)(ds_opt, **params)
    assert lrs_of(ours_opt) == pytest.approx(lrs_of(ds_opt), **APPROX)
    for _ in range(20):
        ours.step()
        theirs.step()
        assert lrs_of(ours_opt) == pytest.approx(lrs_of(ds_opt), **APPROX)
        assert [g.get("betas") for g in ours_opt.param_groups] == [g.get("betas") for g in ds_opt.param_groups]
