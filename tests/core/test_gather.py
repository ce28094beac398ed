"""The gather's host copy (``offload_core.gather.HostCopy``): bit for bit whatever the layout, in chunks that
its threads share, and through the engine under the stream checker, whose host copy it is."""
from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from offload_core import apply_group_offload, gather
from offload_core.gather import HostCopy, plain_bytes
from offload_core.hostmem import FileMappings, SourceFiles, map_file
from offload_core.mirror import InPlaceMirror, ManyCopy, pack_layout, segment_views
from offload_core.runtime import CudaRuntime
from testbed.core_models import mapped_pair
from testbed.core_models import ScaledInt8, quantized_pair

#: Small chunks, no multiple of a page or of the tensors' sizes: a tensor spans many, the threads share them.
CHUNK = 3 * 4096 + 24


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    monkeypatch.setattr(gather, "CHUNK_BYTES", CHUNK)


class Marked(torch.Tensor):
    """A plain tensor subclass: its bytes are its values, but the copy is left to torch."""


def random_bytes(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random bits of ``dtype`` (NaNs and all, so that only a bit-for-bit copy compares equal byte for byte)."""
    numel = torch.Size(shape).numel()
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (numel * dtype.itemsize,), dtype=torch.uint8, generator=generator).view(dtype).view(shape)


def layouts() -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """(target, source) pairs of every kind a gather meets: plain ones of all sizes and the ones torch copies."""
    big = random_bytes((37, 1001), torch.bfloat16, 0)  # 74 kB: 7 chunks, the last one short
    square = random_bytes((64, 64), torch.float32, 1)
    complex_ = torch.randn(8, 8, dtype=torch.complex64)
    pairs = {
        "spans many chunks": (torch.empty_like(big), big),
        "one chunk exactly": (torch.empty(CHUNK, dtype=torch.uint8), random_bytes((CHUNK,), torch.uint8, 2)),
        "one element": (torch.empty(1, dtype=torch.float16), random_bytes((1,), torch.float16, 3)),
        "empty": (torch.empty(0, 5), torch.empty(0, 5)),
        "a Parameter": (torch.empty(3, 5), torch.nn.Parameter(random_bytes((3, 5), torch.float32, 4))),
        "transposed source": (torch.empty(64, 64), square.t()),
        "stepped source": (torch.empty(32, 64), square[::2]),
        "strided target": (torch.empty(64, 128)[:, ::2], square),
        "another dtype": (torch.empty(64, 64, dtype=torch.float16), torch.randn(64, 64)),
        "conjugated": (torch.empty(8, 8, dtype=torch.complex64), complex_.conj()),
        "negated": (torch.empty(8, 8, dtype=torch.complex64), complex_.conj().imag.neg().view(8, 8)),
        "a tensor subclass": (torch.empty(64, 64), square.as_subclass(Marked)),
    }
    return pairs


def expected(target: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
    reference = torch.empty_like(target)
    reference.copy_(source)
    return reference


def bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().view(torch.uint8) if tensor.numel() else tensor


@pytest.mark.parametrize("threads", [1, 3])
def test_every_layout_is_copied_bit_for_bit(threads):
    pairs = layouts()
    targets, sources = zip(*pairs.values())
    references = [expected(t, s) for t, s in zip(targets, sources)]
    HostCopy(threads).many(targets, sources)
    for name, target, reference in zip(pairs, targets, references):
        assert torch.equal(bits(target), bits(reference)), name
    plain = {name for name, (t, s) in pairs.items() if plain_bytes(t, s)}
    assert plain == {"spans many chunks", "one chunk exactly", "one element", "empty", "a Parameter"}


def test_one_pair_is_a_copy_of_many():
    source = random_bytes((5000,), torch.float32, 5)
    target = torch.empty_like(source)
    HostCopy(2)(target, source)
    assert torch.equal(bits(target), bits(source))


def test_a_bad_pair_raises_as_torch_does():
    with pytest.raises(RuntimeError):
        HostCopy(2).many([torch.empty(3)], [torch.empty(4)])


def test_threads_asking_at_once_share_the_pool():
    copy = HostCopy(3)
    sources = [random_bytes((20000,), torch.int32, seed) for seed in range(6)]
    targets = [torch.empty_like(s) for s in sources]
    askers = [threading.Thread(target=copy, args=(t, s)) for t, s in zip(targets, sources)]
    for asker in askers:
        asker.start()
    for asker in askers:
        asker.join()
    assert all(torch.equal(t, s) for t, s in zip(targets, sources))


def test_a_group_kept_in_place_gathers_as_tensor_by_tensor(tmp_path: Path):
    """A mapped file's tensors at offsets no page or chunk aligns: the packed bytes, and the bytes the page
    cache lacked, are those of torch's copy tensor by tensor."""
    shapes = [(300, 7), (1,), (4096,), (129, 65), (3,), (9000,)]
    sizes = [torch.Size(s).numel() * 2 for s in shapes]
    path = tmp_path / "model.bin"
    path.write_bytes(random_bytes((14 + sum(sizes),), torch.uint8, 6).numpy().tobytes())
    mapped, offset, views = map_file(path), 14, []
    for shape, size in zip(shapes, sizes):
        views.append(mapped[offset : offset + size].view(torch.bfloat16).view(shape))
        offset += size
    segments, nbytes = pack_layout(views)
    mirror = InPlaceMirror(segments, nbytes, views, FileMappings(), SourceFiles())
    assert mirror.file_backed_bytes > 0
    fast, plain = torch.full((nbytes,), 7, dtype=torch.uint8), torch.full((nbytes,), 7, dtype=torch.uint8)
    assert mirror.gather_into(fast, HostCopy(3)) == mirror.gather_into(plain, lambda t, s: t.copy_(s))
    assert torch.equal(fast, plain)
    assert all(torch.equal(bits(into), bits(view)) for into, view in zip(segment_views(fast, segments), views))


def test_the_cuda_runtime_gathers_whole_groups():
    assert isinstance(CudaRuntime(torch.device("cpu")).host_copy, ManyCopy)


def test_groups_kept_in_place_stream_bit_identically_through_the_gather(tmp_path, checker):
    """Under the stream checker the worker's gathers are ``HostCopy``'s: ordered, and the output exact."""
    reference, offloaded, x = mapped_pair(tmp_path)
    handle = apply_group_offload(offloaded, offloaded.blocks, "cpu", prefetch=1, runtime=checker, host_budget=0)
    with torch.inference_mode():
        for _ in range(2):
            assert torch.equal(offloaded(x), reference(x))
    assert handle.stats()["gathers"] > 0
    handle.remove()


def test_a_quantized_weights_inner_tensors_and_strided_weights_gather_exactly(checker):
    """A wrapper subclass is kept in place as its inner tensors; a transposed weight as a strided view."""
    reference, offloaded, x = quantized_pair(ScaledInt8.quantize)
    for model in (reference, offloaded):
        first = next(m for m in model.blocks.modules() if isinstance(m, torch.nn.Linear) and m.bias is not None)
        first.bias = torch.nn.Parameter(first.bias.detach().repeat(2)[::2])  # the same values, strided
    handle = apply_group_offload(offloaded, offloaded.blocks, "cpu", prefetch=1, runtime=checker, host_budget=0)
    assert any(isinstance(p, ScaledInt8) for p in offloaded.blocks.parameters())
    with torch.inference_mode():
        for _ in range(2):
            assert torch.equal(offloaded(x), reference(x))
    assert handle.stats()["gathers"] > 0
    handle.remove()
