"""One state per model (``nodes/model_state.py``): every patcher of a model, offloaded or plain, finds the same
state, keyed by the model the patchers hold; it goes with that model; two models have two."""
from __future__ import annotations

import gc
import weakref

import torch

from testbed.run_nodes import run_node, run_txt2img
from testbed.node_runs import load_offloaded, load_plain, offload, offload_handle
from testbed.pack_modules import pack_module


def with_shift(model, shift: float):
    return run_node("ModelSamplingAuraFlow", model=model, shift=shift).outputs[0]


def registered() -> list:
    """The models the registry holds a state for, after a full garbage collection."""
    gc.collect()
    return [model for model, _ in pack_module("nodes.model_state").every_state()]


def test_a_model_its_clones_and_its_plain_patcher_share_one_state_that_goes_with_the_model(models):
    state_of = pack_module("nodes.model_state").state_of
    before = registered()
    plain = load_plain()
    offloaded = offload(plain)
    run_txt2img(offloaded, seed=21)
    shifted = with_shift(offloaded, 2.0)  # a clone ComfyUI runs without loading it again
    added = [model is offloaded.model for model in registered() if not any(model is known for known in before)]
    assert added == [True], "one entry, keyed by the model, not by its diffusion model"

    state = state_of(offloaded.model)
    assert state is state_of(shifted.model) is state_of(plain.model)
    assert state.handle() is offload_handle(offloaded) and len(state.guards) == 2
    assert {id(p) for p in state.offload_patchers} == {id(offloaded), id(shifted)}, "the plain patcher is not one"
    assert state.owners == 2
    assert state.run is None and state.last_run["steps"] > 0 and state.run_activations > 0
    report = run_node("GroupOffloadReport", model=shifted, samples={"samples": torch.zeros(1)}).ui["group_offload"][0]
    assert report is state.last_run, "a clone reports the model's last run"

    del shifted
    gc.collect()
    assert state.owners == 1 and offload_handle(offloaded) is not None
    handle = weakref.ref(offload_handle(offloaded))
    del offloaded
    gc.collect()
    assert state.owners == 0 and handle() is None and state.handle is None and not state.guards
    assert offload_handle(plain) is None, "the last offloaded patcher took the handle with it"

    state_ref, model_ref = weakref.ref(state), weakref.ref(plain.model)
    del state, plain
    assert model_ref() is None and state_ref() is None, "the state goes with its model"
    assert len(registered()) == len(before)


def test_two_models_have_two_states(models):
    model_state, handles = pack_module("nodes.model_state"), pack_module("nodes.handles")
    first, second = load_offloaded(), load_offloaded()
    assert first.model is not second.model
    for model in (first, second, first):
        run_txt2img(model, seed=22)
    one, two = model_state.state_of(first.model), model_state.state_of(second.model)
    assert one is not two
    assert (one.handle(), two.handle()) == (offload_handle(first), offload_handle(second))
    assert one.run_started > two.run_started > 0, "the model run longest ago gives its pins up first"
    packed = [offload_handle(m).stats()["packed_bytes"] for m in (first, second)]
    assert handles.packed_host_bytes() >= sum(packed) > 0
