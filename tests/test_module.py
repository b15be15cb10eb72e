"""The parameter plumbing: children register themselves, one layout over the trainable leaves."""
import numpy as np
import pytest

from tbp import GPT, ModelConfig
from tbp.nn.layout import Layout
from tbp.nn.linear import Linear, LoRA
from tbp.nn.module import Module, Stack
from tbp.nn.lora import add_lora, merge_lora

CFG = ModelConfig(vocab_size=11, n_ctx=8, n_layer=2, n_head=2, d_model=8)


def test_children_register_on_assignment_and_replacement():
    rng = np.random.default_rng(0)

    class Pair(Module):
        def __init__(self):
            super().__init__()
            self.first = Linear(3, 4, rng, np.float64)
            self.second = Linear(4, 2, rng, np.float64, bias=False)

    pair = Pair()
    assert list(pair.params) == ["first.weight", "first.bias", "second.weight"]
    pair.second = Linear(4, 5, rng, np.float64)           # replacing a child re-registers it
    assert pair.params["second.weight"].shape == (4, 5) and "second.bias" in pair.grads
    pair.second = None                                    # and removing it unregisters it
    assert list(pair.params) == ["first.weight", "first.bias"]


def test_stack_names_its_children_by_index():
    rng = np.random.default_rng(0)
    stack = Stack(Linear(2, 2, rng) for _ in range(3))
    assert len(stack) == 3 and stack[-1] is list(stack)[2]
    assert [k for k in stack.params if k.endswith("weight")] == ["0.weight", "1.weight", "2.weight"]


def test_every_trainable_parameter_is_a_view_into_the_layout():
    model = GPT(CFG, seed=0)
    layout = model.layout
    assert layout.size == model.num_params()
    for name, p in model.params.items():
        assert np.shares_memory(p, layout.params) and np.shares_memory(model.grads[name], layout.grads)
        np.testing.assert_array_equal(layout.entries[name].view(layout.params), p)
    decays = [name for name, e in layout.entries.items() if e.decays]
    assert set(decays) == {k for k, p in model.params.items() if p.ndim >= 2}
    # matrices first: weight decay is one contiguous prefix
    assert max(layout.entries[k].offset for k in decays) < layout.n_decay
    assert all(e.offset >= layout.n_decay for e in layout.entries.values() if not e.decays)


def test_lora_packs_only_the_adapters_and_the_names_stay_live():
    model = GPT(CFG, seed=0)
    base_wte = model.params["wte"].copy()
    adapted = add_lora(model, 2, 4.0)
    assert len(adapted) == 8 and isinstance(model.blocks[0].attn.c_attn, LoRA)
    assert set(model.layout.entries) == set(model.grads) == {k for k in model.params if "lora_" in k}
    assert not np.shares_memory(model.params["wte"], model.layout.params)   # frozen: a plain array
    np.testing.assert_array_equal(model.params["wte"], base_wte)
    model.layout.params += 1.0                           # an optimizer step reaches the live tensors
    assert all((model.params[k] != 0).all() for k in model.grads if k.endswith("lora_up"))


def test_merge_makes_every_parameter_trainable_again():
    model = GPT(CFG, seed=0, dtype=np.float64)
    idx = np.arange(6)[None] % 11
    add_lora(model, 2, 4.0)
    for k in model.grads:
        model.params[k][...] = 0.1
    adapted = model.forward(idx).copy()
    merge_lora(model)
    assert set(model.grads) == set(model.params) == set(model.layout.entries)
    assert not any("lora_" in k for k in model.params)
    np.testing.assert_allclose(model.forward(idx), adapted, rtol=1e-12)


def test_linear_from_arrays_holds_the_given_arrays():
    w, b = np.ones((3, 2)), np.zeros(2)
    lin = Linear.from_arrays(w, b)
    assert lin.params["weight"] is w and lin.params["bias"] is b and (lin.d_in, lin.d_out) == (3, 2)
    assert lin.forward(np.ones((1, 3))).tolist() == [[3.0, 3.0]]


def test_a_replica_shares_parameters_and_owns_gradients_and_caches():
    model = GPT(CFG, seed=0)
    idx = np.arange(6)[None] % 11
    model.forward(idx)
    twin = model.replica()
    assert twin.layout.params is model.layout.params and twin.layout.grads is not model.layout.grads
    assert model.blocks[0].attn.cache is not None and twin.blocks[0].attn.cache is None
    twin.accumulate(idx, idx)
    assert np.abs(twin.layout.grads).sum() > 0 and not model.layout.grads.any()


def test_a_layout_needs_something_to_train():
    model = GPT(CFG, seed=0)
    model.freeze()
    with pytest.raises(ValueError, match="nothing to train"):
        Layout(model)
