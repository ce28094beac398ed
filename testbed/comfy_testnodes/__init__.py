"""TEST ONLY node pack for the Group Offload tests; never installed for users.

Importing it widens ComfyUI's Qwen-Image detection (see ``fixture_models.widen_qwen_detection``) and narrows its
text-encoder detection (``text_encoders.narrow_text_encoder_configs``) so that a server started with it can load the
tiny fixture models, and registers a node that stands in for the
7B Qwen text encoder, one that makes a block of a model run out of GPU memory (see
``GroupOffloadTestOutOfMemory``) and one that gives a model a weight Group Offload cannot pack
(``GroupOffloadTestPlainSubclass``). With ``GROUP_OFFLOAD_FAKE_CUDART=1`` in its environment the server pins through
the CUDA-runtime stand-in (``fake_cudart``) and answers ``GET /group_offload_test/pins``; with
``GROUP_OFFLOAD_HOLD_WORKER_GC=1`` a ``POST /free`` after the first prompt is certain to land where
ComfyUI's queue misses it (see ``hold_the_workers_first_collection``).
"""
import gc
import linecache
import os
import sys
import time
import weakref
from pathlib import Path

import torch

_REPO_ROOT = str(Path(__file__).resolve().parents[2])  # where the testbed package is (appended: see comfy_boot)
if _REPO_ROOT not in sys.path:
    sys.path.append(_REPO_ROOT)

from testbed.fixture_models import widen_qwen_detection  # noqa: E402
from testbed.run_nodes import make_test_conditioning  # noqa: E402
from testbed.text_encoders import narrow_text_encoder_configs  # noqa: E402

widen_qwen_detection()
narrow_text_encoder_configs()

_fake_cudart = None  # the CUDA-runtime stand-in, when the server runs with it
if os.environ.get("GROUP_OFFLOAD_FAKE_CUDART") == "1":
    import comfy.model_management
    from aiohttp import web
    from testbed.fake_cudart import install
    from server import PromptServer

    _fake_cudart = install()

    @PromptServer.instance.routes.get("/group_offload_test/pins")
    async def _pins(request):
        return web.json_response({"registered_bytes": _fake_cudart.registered_bytes,
                                  "total_pinned": comfy.model_management.TOTAL_PINNED_MEMORY})


HOLD_LIMIT_S = 60.0  # a test that never posts /free does not stop the server for good


def hold_the_workers_first_collection() -> None:
    """The prompt worker's first garbage collection of its own (after the first prompt, once it has read
    the /free flags) waits until a ``POST /free`` has set new ones.

    ComfyUI's worker reads the flags after each prompt, collects garbage, then waits for its queue; that
    wait does not look at the flags, so flags set in between wake nothing (issue 24). A POST /free that
    arrives during that collection (a few hundred milliseconds) is rare, but happens on a loaded host:
    this makes it certain.
    """
    from server import PromptServer

    held = False

    def hold(phase: str, info: dict) -> None:
        nonlocal held
        if held or phase != "start" or not _called_gc_collect(sys._getframe(1), "prompt_worker"):
            return
        held = True
        queue, deadline = PromptServer.instance.prompt_queue, time.monotonic() + HOLD_LIMIT_S
        while not queue.get_flags(reset=False) and time.monotonic() < deadline:
            time.sleep(0.01)

    gc.callbacks.append(hold)


def _called_gc_collect(frame, function: str) -> bool:
    """Whether ``frame`` (what ran when a collection began) is ``function`` calling ``gc.collect()``,
    not an allocation of it that started an automatic collection."""
    line = linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip()
    return frame.f_code.co_name == function and line == "gc.collect()"


if os.environ.get("GROUP_OFFLOAD_HOLD_WORKER_GC") == "1":
    hold_the_workers_first_collection()


class GroupOffloadTestConditioning:
    """A seeded random CONDITIONING shaped like Qwen-Image's text encoder output."""

    TITLE = "Test Conditioning (Group Offload tests)"
    CATEGORY = "testing/group_offload"
    DESCRIPTION = "Seeded random Qwen-Image-shaped conditioning, standing in for the 7B text encoder in tests."
    RETURN_TYPES = ("CONDITIONING",)
    FUNCTION = "make"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "seed": ("INT", {"default": 0, "min": 0, "max": 2**31 - 1, "tooltip": "Seed of the random embedding."}),
            "tokens": ("INT", {"default": 8, "min": 1, "max": 4096, "tooltip": "Number of text tokens."}),
            "joint_dim": ("INT", {"default": 64, "min": 1, "max": 8192,
                                  "tooltip": "Text width: 64 for the tiny test model, 3584 for real Qwen-Image."}),
        }}

    def make(self, seed: int, tokens: int, joint_dim: int):
        return (make_test_conditioning(seed, tokens, joint_dim),)


def live_objects() -> dict[str, int]:
    """After a full garbage collection: the pack's handles and host mirrors still alive (found by type
    name, so that no module of the pack is imported twice), ComfyUI's diffusion models, and the RSS."""
    import comfy.model_base

    gc.collect()
    counts = {"handles": 0, "onloaded_groups": 0, "host_mirrors": 0, "host_mirror_bytes": 0, "offload_patchers": 0,
              "diffusion_models": 0}
    for obj in gc.get_objects():
        kind = type(obj).__name__
        if kind == "GroupOffloadHandle":
            counts["handles"] += 1
            counts["onloaded_groups"] += sum(group.onloaded for group in obj.groups)
        elif kind == "HostMirror":
            counts["host_mirrors"] += 1
            counts["host_mirror_bytes"] += obj.nbytes
        elif kind == "GroupOffloadPatcher":
            counts["offload_patchers"] += 1
        elif isinstance(obj, comfy.model_base.BaseModel):
            counts["diffusion_models"] += 1
    counts["registered_bytes"] = _fake_cudart.registered_bytes if _fake_cudart is not None else 0
    with open("/proc/self/statm") as statm:
        counts["rss_bytes"] = int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return counts


class GroupOffloadTestLiveObjects:
    """Reports :func:`live_objects` in its UI output; runs at every prompt (never cached)."""

    TITLE = "Live Objects (Group Offload tests)"
    CATEGORY = "testing/group_offload"
    DESCRIPTION = "Counts the pack's live handles and host mirrors, ComfyUI's diffusion models and the RSS."
    RETURN_TYPES = ()
    FUNCTION = "count"
    OUTPUT_NODE = True

    @classmethod
    def INPUT_TYPES(cls):
        return {"optional": {
            "model": ("MODEL", {"tooltip": "A model to keep alive while counting."}),
            "samples": ("LATENT", {"tooltip": "Connect a sampler's output to count after it ran."}),
        }}

    @classmethod
    def IS_CHANGED(cls, **_):
        return float("nan")  # never equal to itself: ComfyUI runs the node every time

    def count(self, model=None, samples=None):
        return {"ui": {"live": [live_objects()]}}


OUT_OF_MEMORY_OPTION = "group_offload_test_out_of_memory"  # in a patcher's transformer_options


class InjectedOutOfMemory:
    """Which runs of one transformer block run out of memory: ``failures`` of them after the first
    ``after``. Shared by the clones of a patcher (ComfyUI copies the dicts of its model options, not
    the objects in them)."""

    def __init__(self, block: int, failures: int, after: int) -> None:
        self.block = block
        self.runs_left_before_failing = after
        self.failures_left = failures

    def take(self, block: int) -> bool:
        """Whether this run of ``block`` fails; called once per run of the block."""
        if block != self.block or self.failures_left == 0:
            return False
        if self.runs_left_before_failing:
            self.runs_left_before_failing -= 1
            return False
        self.failures_left -= 1
        return True


_HOOKED_BLOCKS: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()


def _hook_block(base_model, index: int) -> None:
    """Once per block: at each run of the block, its first module to run raises torch.OutOfMemoryError
    when the ``InjectedOutOfMemory`` of the patcher that runs the model says so. It raises inside the
    block's forward, where an activation that does not fit would."""
    block = base_model.diffusion_model.transformer_blocks[index]
    if block in _HOOKED_BLOCKS:
        return
    _HOOKED_BLOCKS.add(block)
    model = weakref.ref(base_model)
    checked = False

    def run_starts(module, args):
        nonlocal checked
        checked = False

    def run_out(module, args):
        nonlocal checked
        if checked:
            return
        checked = True
        patcher = getattr(model(), "current_patcher", None)
        injected = None if patcher is None else patcher.model_options["transformer_options"].get(OUT_OF_MEMORY_OPTION)
        if injected is not None and injected.take(index):
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate 2.00 GiB "
                                         f"(injected at transformer block {index} by the Group Offload tests)")

    block.register_forward_pre_hook(run_starts)
    for child in block.children():
        child.register_forward_pre_hook(run_out)


class GroupOffloadTestOutOfMemory:
    """A clone of the model whose ``block``-th transformer block runs out of GPU memory ``failures``
    times it runs, after ``after`` runs that succeed (Qwen-Image models)."""

    TITLE = "Out Of Memory (Group Offload tests)"
    CATEGORY = "testing/group_offload"
    DESCRIPTION = "Makes a transformer block of the model raise torch.OutOfMemoryError N times it runs."
    RETURN_TYPES = ("MODEL",)
    FUNCTION = "inject"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "model": ("MODEL", {"tooltip": "A Qwen-Image model, offloaded or not."}),
            "block": ("INT", {"default": 0, "min": 0, "max": 1000, "tooltip": "Index of the transformer block."}),
            "failures": ("INT", {"default": 1, "min": 1, "max": 10000, "tooltip": "How many runs of the block fail."}),
            "after": ("INT", {"default": 0, "min": 0, "max": 10000,
                              "tooltip": "How many runs of the block succeed before the first failure."}),
        }}

    def inject(self, model, block: int, failures: int, after: int):
        clone = model.clone()
        clone.model_options["transformer_options"][OUT_OF_MEMORY_OPTION] = InjectedOutOfMemory(block, failures, after)
        _hook_block(clone.model, block)
        return (clone,)


class PlainSubclass(torch.Tensor):
    """A tensor subclass that is neither GGUF-like (its meaning its bytes and its attributes) nor a wrapper
    subclass: a tensor beside its bytes, as a scale, without the wrapper protocol."""


class GroupOffloadTestPlainSubclass:
    """The model with the first Linear weight of its first transformer block made a ``PlainSubclass``, in
    place: the model is changed for good (give it a file of its own)."""

    TITLE = "Plain Subclass (Group Offload tests)"
    CATEGORY = "testing/group_offload"
    DESCRIPTION = "Makes a weight of the model's first transformer block a tensor subclass Group Offload cannot pack."
    RETURN_TYPES = ("MODEL",)
    FUNCTION = "change"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"model": ("MODEL", {"tooltip": "A Qwen-Image model."})}}

    def change(self, model):
        block = model.model.diffusion_model.transformer_blocks[0]
        linear = next(m for m in block.modules() if isinstance(m, torch.nn.Linear))
        linear.weight = torch.nn.Parameter(linear.weight.detach().as_subclass(PlainSubclass), requires_grad=False)
        linear.weight.scale = torch.ones(1)
        return (model,)


NODE_CLASS_MAPPINGS = {"GroupOffloadTestConditioning": GroupOffloadTestConditioning,
                       "GroupOffloadTestLiveObjects": GroupOffloadTestLiveObjects,
                       "GroupOffloadTestOutOfMemory": GroupOffloadTestOutOfMemory,
                       "GroupOffloadTestPlainSubclass": GroupOffloadTestPlainSubclass}
NODE_DISPLAY_NAME_MAPPINGS = {name: cls.TITLE for name, cls in NODE_CLASS_MAPPINGS.items()}
