"""Stage-3 unit selection and the gathered-memory pool (single process, no collectives)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import zeroshard

from zeroshard.core.layout import StoragePool, flatten
from zeroshard.core.partition import build_stage3_layout, unit_modules
from tests.models import make_model


def _all_params(model):
    return {id(p): 0 for p in model.parameters()}


def test_repeating_block_class_becomes_the_units():
    # TinyLM: two Sequential blocks; the Linear/LayerNorm classes repeat only inside them.
    assert [n for n, _ in unit_modules(make_model())] == ["block1", "block2"]


def test_a_flat_stack_of_layers_makes_each_layer_a_unit():
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.Linear(8, 2))
    assert [n for n, _ in unit_modules(model)] == ["0", "2", "3"]


def test_containers_never_become_units():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.enc = nn.ModuleList([nn.Linear(4, 4) for _ in range(2)])
            self.dec = nn.ModuleList([nn.Linear(4, 4) for _ in range(2)])

    assert [n for n, _ in unit_modules(Net())] == ["enc.0", "enc.1", "dec.0", "dec.1"]


def test_named_unit_classes_and_a_helpful_error():
    names = [n for n, _ in unit_modules(make_model(), ["Linear", "Embedding"])]
    assert names == ["embed", "block1.1", "block1.3", "block2.1", "block2.3", "head"]
    with pytest.raises(ValueError, match=r"zeroshard_unit_classes: no module of class \['Block'\]"
                                         r" in TinyLM; classes present: .*Sequential"):
        unit_modules(make_model(), ["Block"])


@pytest.mark.parametrize("threshold", [0, 40])
def test_layout_covers_every_parameter_once_and_ties_span_units(threshold):
    model = make_model()
    values = {n: p.detach().clone() for n, p in model.named_parameters()}
    layout = build_stage3_layout(model, _all_params(model), world_size=3, bucket_numel=100,
                                 persistence_threshold=threshold,
                                 class_names=["Linear", "Embedding", "LayerNorm"])
    names = sorted(s.name for u in layout.units for s in u.slots)
    assert names == sorted(values)  # the tied embed/head weight is laid out once
    for unit in layout.units:
        assert unit.flat is None  # laying out allocates nothing; materialize.py fills units
        flatten(unit)
        for slot, view in unit.views(unit.flat):
            assert torch.equal(view, values[slot.name])  # values carried into the flat buffer
        small = all(s.numel < threshold for s in unit.slots)
        assert (unit.index in layout.persistent) == (threshold > 0 and small)
    # The head owns no unit of its own: it needs the embedding's unit (a weight tied across units).
    embed_unit = next(u.index for u in layout.units if u.slots[0].name == "embed.weight")
    assert embed_unit in layout.needs[id(model.head)]
    assert embed_unit in layout.borrowed[id(model.head)]  # freed after the head's backward


def test_pool_moves_bytes_but_keeps_the_storage_that_views_hold():
    pool = StoragePool()
    flat = torch.zeros(64)
    saved_view = flat[8:16]  # what autograd would have saved in forward
    storage = flat.untyped_storage()
    storage.resize_(0)
    pool.lend(storage, 64 * 4)
    flat.fill_(3.0)
    assert torch.equal(saved_view, torch.full((8,), 3.0))
    pool.take_back(storage)
    assert storage.nbytes() == 0 and len(pool.tensors()) == 1
    other = torch.zeros(64)
    other.untyped_storage().resize_(0)
    pool.lend(other.untyped_storage(), 64 * 4)  # the same bytes serve another unit of that size
    assert len(pool.tensors()) == 0 and other.untyped_storage().nbytes() == 256
    assert pool.fresh == 1  # the second lend reused the first block


def test_the_cpu_accelerators_empty_cache_empties_every_pool():
    """get_accelerator().empty_cache() on the host frees spare gathered memory, as
    torch.cuda.empty_cache frees the caching allocator's, and leaves lent blocks alone."""
    from zeroshard.compat.deepspeed.accelerator.cpu import CpuAccelerator

    pools = [StoragePool(), StoragePool()]
    lent = torch.zeros(16)
    for pool in pools:
        storage = torch.zeros(16).untyped_storage()
        storage.resize_(0)
        pool.lend(storage, 64)
        pool.take_back(storage)
    lent.untyped_storage().resize_(0)
    pools[0].lend(lent.untyped_storage(), 64)
    pools[0].take_back(torch.zeros(32).untyped_storage())  # a second spare, of another size
    CpuAccelerator().empty_cache()
    assert all(pool.tensors() == [] for pool in pools)
    assert lent.untyped_storage().nbytes() == 64


class MiniGPT(nn.Module):
    """GPT-2's shape: embeddings, repeated blocks, a final norm, a head tied to the embedding."""

    def __init__(self):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(50, 8), nn.Embedding(16, 8)
        self.h = nn.ModuleList(nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 8)) for _ in range(2))
        self.ln_f = nn.LayerNorm(8)
        self.lm_head = nn.Linear(8, 50, bias=False)
        self.lm_head.weight = self.wte.weight
        self.gates = nn.ParameterList([nn.Parameter(torch.ones(8)) for _ in range(2)])


def _owners(layout):
    return {u.owner: u.index for u in layout.units}


def test_parameters_outside_blocks_form_a_unit_per_owning_module():
    model = MiniGPT()
    layout = build_stage3_layout(model, _all_params(model), world_size=2, bucket_numel=100,
                                 persistence_threshold=0)
    owners = _owners(layout)
    # The ParameterList's parameters are used by its parent (the root): a root unit.
    assert set(owners) == {"wte", "wpe", "h.0", "h.1", "ln_f", "<root>"}
    assert sum(s.name == "wte.weight" for u in layout.units for s in u.slots) == 1  # tied: once
    assert not any(s.name == "lm_head.weight" for u in layout.units for s in u.slots)
    # Each module gathers what it holds; the head borrows the embedding's unit.
    assert layout.needs[id(model.wte)] == [owners["wte"]] and not layout.borrowed[id(model.wte)]
    assert layout.needs[id(model.ln_f)] == [owners["ln_f"]]
    assert layout.needs[id(model.lm_head)] == layout.borrowed[id(model.lm_head)] == [owners["wte"]]
    assert layout.needs[id(model)] == [owners["<root>"]]  # not the embedding, norm or head
    assert id(model.gates) not in layout.needs


def test_an_external_parameter_is_gathered_by_the_module_that_uses_it():
    model = MiniGPT()
    zeroshard.zero.register_external_parameter(model.ln_f, model.wpe.weight)
    layout = build_stage3_layout(model, _all_params(model), world_size=2, bucket_numel=100,
                                 persistence_threshold=0)
    owners = _owners(layout)
    assert layout.needs[id(model.ln_f)] == sorted([owners["ln_f"], owners["wpe"]])
    assert layout.borrowed[id(model.ln_f)] == [owners["wpe"]]
