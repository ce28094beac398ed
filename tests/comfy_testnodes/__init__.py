"""TEST ONLY node pack for the Group Offload tests; never installed for users.

Importing it widens ComfyUI's Qwen-Image detection (see ``comfy_env.widen_qwen_detection``) so that a
server started with it can load the tiny fixture models, and registers a node that stands in for the
7B Qwen text encoder. With ``GROUP_OFFLOAD_FAKE_CUDART=1`` in its environment the server pins through
the CUDA-runtime stand-in (``fake_cudart``) and answers ``GET /group_offload_test/pins``.
"""
import gc
import os
import sys
from pathlib import Path

_TESTS_DIR = str(Path(__file__).resolve().parent.parent)
if _TESTS_DIR not in sys.path:
    sys.path.append(_TESTS_DIR)

from comfy_env import make_test_conditioning, widen_qwen_detection  # noqa: E402

widen_qwen_detection()

_fake_cudart = None  # the CUDA-runtime stand-in, when the server runs with it
if os.environ.get("GROUP_OFFLOAD_FAKE_CUDART") == "1":
    import comfy.model_management
    from aiohttp import web
    from fake_cudart import install
    from server import PromptServer

    _fake_cudart = install()

    @PromptServer.instance.routes.get("/group_offload_test/pins")
    async def _pins(request):
        return web.json_response({"registered_bytes": _fake_cudart.registered_bytes,
                                  "total_pinned": comfy.model_management.TOTAL_PINNED_MEMORY})


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
    """After a full garbage collection: the pack's engines and host mirrors still alive (found by type
    name, so that no module of the pack is imported twice), ComfyUI's diffusion models, and the RSS."""
    import comfy.model_base

    gc.collect()
    counts = {"engines": 0, "onloaded_groups": 0, "host_mirrors": 0, "host_mirror_bytes": 0, "offload_patchers": 0,
              "diffusion_models": 0}
    for obj in gc.get_objects():
        kind = type(obj).__name__
        if kind == "GroupOffloadHandle":
            counts["engines"] += 1
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
    DESCRIPTION = "Counts the pack's live engines and host mirrors, ComfyUI's diffusion models and the RSS."
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


NODE_CLASS_MAPPINGS = {"GroupOffloadTestConditioning": GroupOffloadTestConditioning,
                       "GroupOffloadTestLiveObjects": GroupOffloadTestLiveObjects}
NODE_DISPLAY_NAME_MAPPINGS = {name: cls.TITLE for name, cls in NODE_CLASS_MAPPINGS.items()}
