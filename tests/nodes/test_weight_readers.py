"""Issue 38: the nodes that read an offloaded model's weights outside its sampling run (merges, ModelSave, Extract
and Save LoRA, a custom node patching a weight) get what they get from ComfyUI's own model, bit for bit; a model
file changed under a loaded model is a node error naming what to do, never a dead server (a read of a mapping cut
short is a SIGBUS); ModelComputeDtype reaches the streamed blocks.

On one live server: four-block float32 Qwen-Image files A and B (float32: the blocks are the file's bytes), a LoRA
for A. ComfyUI's own loader reads A; each case offloads its own copy of A, so that a file changed by one case is no
other's (the cases of ``the reproduction script``, ../shared/repro/file_tier_readers.py).
"""
from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import Iterator

import pytest
import torch
from safetensors.torch import load_file

from testbed.fixture_models import tiny_qwen_image_file
from testbed.live_server import ComfyServer
from testbed.lora_fixture import make_lora
from testbed.run_nodes import run_txt2img
from testbed.node_runs import load_plain, offload, with_lora

# Every group left in the file, or planned by ``auto`` (on the CPU: every group resident, its device copy patched).
IN_FILE = {"blocks_per_group": 1, "prefetch": 1, "residency": "stream_all", "resident_gb": 0.0,
           "host_memory": "budget", "host_gb": 0.0}
RESIDENCIES = ["stream_all", "auto"]
MODEL = {"num_layers": 4, "dtype": torch.float32}
ERROR_TYPE = "offload_core.SourceChangedError"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ComfyServer]:
    with ComfyServer(tmp_path_factory.mktemp("weight_readers")) as server:
        models = server.models.models_dir
        a = tiny_qwen_image_file(seed=0, **MODEL)
        shutil.copyfile(a, models / "diffusion_models" / "a.safetensors")
        shutil.copyfile(tiny_qwen_image_file(seed=1, **MODEL), models / "diffusion_models" / "b.safetensors")
        make_lora(a, models / "loras" / "lora_a.safetensors")
        yield server


def copy_of_a(server: ComfyServer, case: str) -> str:
    """A copy of A for one case to offload (and maybe change)."""
    folder = server.models.models_dir / "diffusion_models"
    shutil.copyfile(folder / "a.safetensors", folder / f"a_{case}.safetensors")
    return f"a_{case}.safetensors"


def model_path(server: ComfyServer, name: str) -> Path:
    return server.models.models_dir / "diffusion_models" / name


# --- API-format nodes ---------------------------------------------------------------------------------------------

def plain(name: str) -> dict:
    return {"class_type": "UNETLoader", "inputs": {"unet_name": name, "weight_dtype": "default"}}


def offloaded(name: str, **options) -> dict:
    return {"class_type": "GroupOffloadLoader", "inputs": {"unet_name": name, "weight_dtype": "default",
                                                           **IN_FILE, **options}}


def node(class_type: str, **inputs) -> dict:
    return {"class_type": class_type, "inputs": inputs}


def lora(model: list) -> dict:
    return node("LoraLoaderModelOnly", model=model, lora_name="lora_a.safetensors", strength_model=0.8)


def sampled(nodes: dict, model: list, tag: str = "s", seed: int = 0, steps: int = 2) -> dict:
    """``nodes`` with a KSampler of ``model`` whose latent SaveLatent saves as node ``tag``."""
    nodes = dict(nodes)
    for name, seed_of in (("pos", 1), ("neg", 2)):
        nodes.setdefault(name, node("GroupOffloadTestConditioning", seed=seed_of, tokens=8, joint_dim=64))
    nodes.setdefault("latent", node("EmptySD3LatentImage", width=64, height=64, batch_size=1))
    nodes[f"{tag}k"] = node("KSampler", model=model, seed=seed, steps=steps, cfg=4.0, sampler_name="euler",
                            scheduler="simple", positive=["pos", 0], negative=["neg", 0], latent_image=["latent", 0],
                            denoise=1.0)
    nodes[tag] = node("SaveLatent", samples=[f"{tag}k", 0], filename_prefix=f"latents/{tag}{time.time_ns()}")
    return nodes


# --- running them -------------------------------------------------------------------------------------------------

def latent(server: ComfyServer, prompt: dict, tag: str = "s") -> torch.Tensor:
    (item,) = server.run(prompt)["outputs"][tag]["latents"]
    return load_file(str(server.output_dir / item["subfolder"] / item["filename"]))["latent_tensor"]


def saved(server: ComfyServer, prompt: dict, prefix: str) -> dict[str, torch.Tensor]:
    """The file the prompt's ModelSave or LoraSave (``filename_prefix`` ``prefix``, unique) wrote."""
    server.run(prompt)
    (path,) = server.output_dir.glob(f"{prefix}*.safetensors")
    return load_file(str(path))


def node_error(server: ComfyServer, prompt: dict) -> dict:
    entry = server.wait(server.queue(prompt), check=False)
    errors = [m[1] for m in entry["status"]["messages"] if m[0] == "execution_error"]
    assert errors, "the prompt ran"
    return errors[0]


def assert_refused(error: dict, node_type: str, name: str, problem: str) -> None:
    """A node error naming the file, what happened and what to do; the type without the pack's folder name."""
    assert (error["node_type"], error["exception_type"]) == (node_type, ERROR_TYPE)
    message = error["exception_message"]
    assert message.startswith(f"{name} {problem}") and "Free model and node cache" in message


def assert_same_files(ours: dict[str, torch.Tensor], comfyui: dict[str, torch.Tensor]) -> None:
    assert ours.keys() == comfyui.keys()
    assert not [key for key in ours if not torch.equal(ours[key], comfyui[key])], "tensors differ from ComfyUI's"


# --- readers: bit-identical to ComfyUI ----------------------------------------------------------------------------

@pytest.mark.parametrize("residency", RESIDENCIES)
@pytest.mark.parametrize("merged", ["lora_clone", "base_after_the_lora_clone_ran"])
def test_a_merge_gets_the_host_weights_with_each_patch_once(server, residency, merged):
    """A LoRA clone runs (its patched device copies stay on the device: resident groups, a prefetched first one),
    then it, or the model under it, is merged into B: the LoRA once (C6), or not at all (C7)."""
    def merge_after_the_lora_ran(a: dict) -> dict:
        nodes = sampled({"a": a, "la": lora(["a", 0]), "b": plain("b.safetensors")}, ["la", 0], tag="first")
        nodes["m"] = node("ModelMergeSimple", model1=["b", 0], model2=["la" if merged == "lora_clone" else "a", 0],
                          ratio=0.5)
        return sampled(nodes, ["m", 0], tag="second", seed=1)

    name = copy_of_a(server, f"merge_{residency}_{merged}")
    expected = latent(server, merge_after_the_lora_ran(plain("a.safetensors")), "second")
    assert torch.equal(latent(server, merge_after_the_lora_ran(offloaded(name, residency=residency)), "second"),
                       expected)


@pytest.mark.parametrize("residency", RESIDENCIES)
def test_modelsave_of_a_lora_on_an_offloaded_model_saves_what_comfyui_saves(server, residency):
    """ModelSave loads the model outside sampling and reads its weights: the LoRA once in every tensor (C8)."""
    def save(a: dict, prefix: str) -> dict:
        return {"a": a, "la": lora(["a", 0]), "save": node("ModelSave", model=["la", 0], filename_prefix=prefix)}

    name = copy_of_a(server, f"save_{residency}")
    expected = saved(server, save(plain("a.safetensors"), f"checkpoints/plain_{residency}"), f"checkpoints/plain_{residency}")
    ours = saved(server, save(offloaded(name, residency=residency), f"checkpoints/ours_{residency}"),
                 f"checkpoints/ours_{residency}")
    assert_same_files(ours, expected)


@pytest.mark.parametrize("residency", RESIDENCIES)
def test_lora_extraction_from_a_difference_with_an_offloaded_model(server, residency):
    """Extract and Save LoRA (full_diff) of ModelMergeSubtract(offloaded B', A): B' - A in every tensor (C9)."""
    folder = server.models.models_dir / "diffusion_models"
    shutil.copyfile(folder / "b.safetensors", folder / f"b_{residency}.safetensors")

    def extract(b: dict, prefix: str) -> dict:
        return {"b": b, "a": plain("a.safetensors"),
                "diff": node("ModelMergeSubtract", model1=["b", 0], model2=["a", 0], multiplier=1.0),
                "save": node("LoraSave", filename_prefix=prefix, rank=8, lora_type="full_diff", bias_diff=True,
                             model_diff=["diff", 0])}

    expected = saved(server, extract(plain("b.safetensors"), f"loras/plain_{residency}"), f"loras/plain_{residency}")
    ours = saved(server, extract(offloaded(f"b_{residency}.safetensors", residency=residency), f"loras/ours_{residency}"),
                 f"loras/ours_{residency}")
    assert_same_files(ours, expected)


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_model_compute_dtype_reaches_the_streamed_blocks(server, dtype):
    def computed_in(a: dict) -> dict:
        return sampled({"a": a, "dt": node("ModelComputeDtype", model=["a", 0], dtype=dtype)}, ["dt", 0], seed=2)

    name = copy_of_a(server, f"dtype_{dtype}")
    assert torch.equal(latent(server, computed_in(offloaded(name))), latent(server, computed_in(plain("a.safetensors"))))


# --- a changed file: a node error, the server alive --------------------------------------------------------------

@pytest.mark.parametrize("residency", RESIDENCIES)
def test_a_file_cut_short_is_refused_by_every_reader(server, residency):
    """Truncated after a run: the next merge (C1) and the next save (C2) fail at their node, before a page of the
    mapping is read (``auto`` keeps the groups resident: ModelSave's load copies them); the server runs on."""
    name = copy_of_a(server, f"cut_short_{residency}")
    a = offloaded(name, residency=residency)
    assert latent(server, sampled({"a": a}, ["a", 0])).isfinite().all()
    size = model_path(server, name).stat().st_size
    os.truncate(model_path(server, name), size // 2)
    merge = sampled({"a": a, "b": plain("b.safetensors"), "m": node("ModelMergeSimple", model1=["b", 0],
                                                                      model2=["a", 0], ratio=0.4)}, ["m", 0])
    assert_refused(node_error(server, merge), "ModelMergeSimple", name, f"is now {size // 2} bytes on disk")
    save = {"a": a, "save": node("ModelSave", model=["a", 0], filename_prefix=f"checkpoints/cut_short_{residency}")}
    assert_refused(node_error(server, save), "ModelSave", name, f"is now {size // 2} bytes on disk")
    assert latent(server, sampled({"a": plain("a.safetensors")}, ["a", 0], seed=3)).isfinite().all()


def test_a_file_cut_short_during_a_run_fails_it_at_the_next_step(server):
    """The truncation waits on the pack's read lease until the run's next step fails with the error (C3)."""
    name = copy_of_a(server, "cut_mid_run")
    a = offloaded(name)
    latent(server, sampled({"a": a}, ["a", 0], steps=1))
    prompt_id = server.queue(sampled({"a": a}, ["a", 0], seed=5, steps=10_000))
    while not server.get("/queue")["queue_running"]:
        time.sleep(0.05)
    time.sleep(1)  # some steps into the run
    size = model_path(server, name).stat().st_size
    os.truncate(model_path(server, name), size // 2)
    entry = server.wait(prompt_id, check=False, timeout=300)
    error = next(m[1] for m in entry["status"]["messages"] if m[0] == "execution_error")
    assert_refused(error, "KSampler", name, "was written to since")
    assert latent(server, sampled({"a": plain("a.safetensors")}, ["a", 0], seed=6)).isfinite().all()


@pytest.mark.parametrize("rewrite", ["other_bytes_old_mtime", "one_page"])
def test_a_file_written_in_place_is_refused(server, rewrite):
    """Rewritten with B's bytes and the old modification time put back (C4), or one page of a block weight changed
    (C5): both refused at the sampler."""
    name = copy_of_a(server, f"rewrite_{rewrite}")
    path = model_path(server, name)
    a = offloaded(name)
    latent(server, sampled({"a": a}, ["a", 0]))
    stat = path.stat()
    with path.open("r+b") as file:
        if rewrite == "one_page":
            file.seek(41 * 4096)
            page = bytearray(file.read(4096))
            page[3::4] = bytes(b ^ 0x40 for b in page[3::4])
            file.seek(41 * 4096)
            file.write(page)
        else:
            file.write(model_path(server, "b.safetensors").read_bytes())
    if rewrite != "one_page":
        os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert_refused(node_error(server, sampled({"a": a}, ["a", 0], seed=1)), "KSampler", name, "was written to since")


def test_a_replaced_file_is_not_the_mapped_one_and_the_next_load_maps_it(server):
    """A new download replaces the path with another file (B, here with two blocks): the loaded model goes on with
    the file it mapped, also through a Group Offload node after the loader that builds its host copies again; a
    changed loader input loads again and maps the new file."""
    name = copy_of_a(server, "replaced")
    expected = latent(server, sampled({"a": plain("a.safetensors")}, ["a", 0], seed=7))
    a = offloaded(name)
    latent(server, sampled({"a": a}, ["a", 0], seed=7))
    new = model_path(server, "new_download.part")
    shutil.copyfile(tiny_qwen_image_file(seed=1, num_layers=2, dtype=torch.float32), new)
    os.replace(new, model_path(server, name))
    again = node("GroupOffload", model=["a", 0], **{**IN_FILE, "prefetch": 0})
    assert torch.equal(latent(server, sampled({"a": a, "again": again}, ["again", 0], seed=7)), expected)
    shutil.copyfile(model_path(server, name), model_path(server, "b2.safetensors"))
    expected_new = latent(server, sampled({"b": plain("b2.safetensors")}, ["b", 0], seed=7))
    assert torch.equal(latent(server, sampled({"a": offloaded(name, prefetch=0)}, ["a", 0], seed=7)), expected_new)


# --- a custom node patching a block weight in place -----------------------------------------------------------------

def test_a_block_weight_patched_in_place_is_refused_and_the_weights_stay(models):
    """``patch_weight_to_device(key, inplace_update=True)`` (C10) would write a host copy or the file's read-only
    pages: refused, and the model still samples as ComfyUI's."""
    expected = run_txt2img(with_lora(load_plain(), 0.8), seed=9).latent
    model = with_lora(offload(load_plain()), 0.8)
    key = next(k for k in model.patches if k.startswith("diffusion_model.transformer_blocks."))
    with pytest.raises(ValueError, match=f"cannot patch {key} in place"):
        model.patch_weight_to_device(key, device_to=model.load_device, inplace_update=True)
    assert torch.equal(run_txt2img(model, seed=9).latent, expected)

