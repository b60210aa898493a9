"""Hugging Face GPT2LMHeadModel and LlamaForCausalLM (tiny configs, no download) train at stage 3
and match the single-process reference (fp32, 1e-5 relative), at world size 2.

SGD with momentum, not Adam: GPT-2's key bias gets a gradient that is zero up to rounding (softmax
ignores it), and Adam turns that noise into full-size steps, at every stage and even at world 1.
"""

from __future__ import annotations

import pytest
import torch

import zeroshard
from tests.harness import run_world

transformers = pytest.importorskip("transformers")

STEPS = 3
MICRO = 2
SEQ = 8
VOCAB = 64


def _gpt2():
    cfg = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=VOCAB, n_positions=32,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(cfg)


def _llama():
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=32)
    return transformers.LlamaForCausalLM(cfg)


MODELS = {"gpt2": _gpt2, "llama": _llama}


def _build(name):
    torch.manual_seed(0)
    return MODELS[name]().float()


def _optimizer(model):
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def _batches(world):
    gen = torch.Generator().manual_seed(3)
    return torch.randint(0, VOCAB, (STEPS, MICRO * world, SEQ), generator=gen)


def _reference(name, world):
    model = _build(name)
    opt = _optimizer(model)
    for ids in _batches(world):
        opt.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _case(rank, world, name, threshold):
    ref = _reference(name, world)
    model = _build(name)
    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_clipping": 0.5,
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": threshold}}
    engine, _, _, _ = zeroshard.initialize(
        model=model, optimizer=_optimizer(model), config=config)
    units = sorted({u.owner for u in engine.optimizer.units})
    for ids in _batches(world):
        mine = ids[rank * MICRO:(rank + 1) * MICRO]
        engine.backward(engine(input_ids=mine, labels=mine).loss)
        engine.step()
    engine.destroy()
    err = max(((p.detach() - ref[n]).abs().max() / ref[n].abs().max()).item()
              for n, p in model.named_parameters())
    return err, units


def _checkpoint(rank, world, root):
    """Train GPT-2 at stage 3, save a checkpoint; return the live weights."""
    model = _build("gpt2")
    engine, _, _, _ = zeroshard.initialize(
        model=model, optimizer=_optimizer(model),
        config={"train_micro_batch_size_per_gpu": MICRO,
                "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}})
    ids = _batches(world)[0][rank * MICRO:(rank + 1) * MICRO]
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()
    engine.save_checkpoint(root)
    live = {k: v.clone() for k, v in engine.consolidated_state_dict(rank0_only=False).items()}
    engine.destroy()
    return live


def _all(rank, world, root):
    out = {(name, t): _case(rank, world, name, t) for name in MODELS for t in (0, 100)}
    out["live"] = _checkpoint(rank, world, root)
    return out


@pytest.fixture(scope="module")
def ckpt_root(tmp_path_factory):
    """Where the GPT-2 checkpoint goes."""
    return tmp_path_factory.mktemp("hf")


@pytest.fixture(scope="module")
def results(ckpt_root):
    """Per-rank (error, unit owners) per model and persistence threshold, and more."""
    return run_world(2, _all, str(ckpt_root / "ckpt"))


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("threshold", [0, 100])
def test_hf_model_matches_reference_at_stage3(results, name, threshold):
    for rank, got in enumerate(results):
        err, units = got[(name, threshold)]
        assert err < 1e-5, f"{name} rank {rank}: max relative error {err:.2e}"
        # The repeating block class became the units (one per layer).
        layer = "transformer.h." if name == "gpt2" else "model.layers."
        assert f"{layer}0" in units and f"{layer}1" in units, units
        if threshold == 0:
            # Outside the blocks: a unit per module holding parameters, none for the root; the
            # GPT-2 head is tied to wte and owns no unit.
            outside = {"gpt2": ["transformer.wte", "transformer.wpe", "transformer.ln_f"],
                       "llama": ["model.embed_tokens", "model.norm", "lm_head"]}[name]
            assert [u for u in units if not u.startswith(layer)] == sorted(outside), units


def test_consolidated_checkpoint_loads_with_from_pretrained(results, ckpt_root):
    from zeroshard.consolidate import consolidate

    consolidate(str(ckpt_root / "ckpt"), str(ckpt_root / "hf"))
    model = transformers.GPT2LMHeadModel.from_pretrained(str(ckpt_root / "hf"))
    live = results[0]["live"]
    state = model.state_dict()
    assert all(torch.equal(state[k], live[k]) for k in live if k in state)
    assert model.lm_head.weight.data_ptr() == model.transformer.wte.weight.data_ptr()  # still tied
