"""The tiny text encoders of ``testbed.text_encoders`` load through ComfyUI's own loader nodes and encode: every
family the ComfyUI in use has, two prompts, and CLIPSetLastLayer where the family honours it."""
from __future__ import annotations

import pytest
import torch

from testbed import text_encoders
from testbed.run_nodes import node_output

PROMPTS = ("a photograph of a cat", "a watercolour of a lighthouse at dusk")


@pytest.mark.parametrize("name", sorted(text_encoders.TEXT_ENCODER_FAMILIES))
def test_family_loads_and_encodes(name: str, te_names: dict[str, str]):
    family = text_encoders.TEXT_ENCODER_FAMILIES[name]
    if not family.available():
        pytest.skip(f"this ComfyUI has no {family.loader} type {family.type!r} for {family.encoders}")
    clip = node_output(family.loader, **family.inputs(te_names))
    encoded = [text_encoders.encode_text(clip, text) for text in PROMPTS]
    for cond, pooled in encoded:
        assert cond.shape[0] == 1 and cond.shape[-1] == family.width
        assert torch.isfinite(cond).all()
        if family.pooled is None:
            assert pooled is None
        else:
            assert pooled.shape == (1, family.pooled) and torch.isfinite(pooled).all()
    (first, _), (second, _) = encoded
    assert first.shape != second.shape or not torch.equal(first, second), "the prompts encode alike"

    if name in text_encoders.CHANGING_LAST_LAYER:
        earlier = node_output("CLIPSetLastLayer", clip=clip, stop_at_clip_layer=text_encoders.CHANGING_LAST_LAYER[name])
        cond, _ = text_encoders.encode_text(earlier, PROMPTS[0])
        assert cond.shape == first.shape and torch.isfinite(cond).all()
        assert not torch.equal(cond, first), "CLIPSetLastLayer changed nothing"


def test_real_widths_are_left_to_comfyui():
    """A state dict of a real encoder's widths is detected by ComfyUI alone (here: T5-XXL's, on the meta device)."""
    text_encoders.narrow_text_encoder_configs()
    import comfy.sd

    sd = {"shared.weight": torch.empty(32128, 4096, device="meta"),
          "encoder.block.0.layer.0.SelfAttention.k.weight": torch.empty(4096, 4096, device="meta")}
    assert text_encoders._identify(sd) is None
    assert comfy.sd.detect_te_model(sd) == comfy.sd.detect_te_model.__wrapped__(sd)
