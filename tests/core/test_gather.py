"""The gather's host copy (``offload_core.gather.HostCopy``): bit for bit whatever the layout, in chunks that
its threads share, and through the engine under the stream checker, whose host copy it is; and how far ahead
of a gather the disk reads (the lookahead from the ledger's measured rates)."""
from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import torch

from offload_core import apply_group_offload, gather
from offload_core import mirror as mirror_module
from offload_core.gather import HostCopy, plain_bytes
from offload_core.hostmem import FileMappings, SourceFiles, map_file, uncached_bytes
from offload_core.ledger import TransferLedger
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


class Mark:
    """A timing event the GPU has passed, ``at`` milliseconds into its stream (the ledger's timers read it)."""

    def __init__(self, at: float) -> None:
        self.at = at

    def query(self) -> bool:
        return True

    def elapsed_time(self, end: "Mark") -> float:
        return end.at - self.at


def fed_ledger(ledger: TransferLedger, gather_ms: float, copy_ms: float, compute_ms: float, groups: int = 1000) -> None:
    """``groups`` gathers, staged copies and runs of the given milliseconds each, as the engine records them."""
    for _ in range(groups):
        ledger.record_gather(1 << 20, 0, gather_ms / 1e3)
        ledger.record_copy_time(Mark(0.0), Mark(copy_ms))
        ledger.record_compute(Mark(0.0), Mark(compute_ms))


@pytest.mark.parametrize("compute_ms, cap, expected", [
    (2.5, 8, 2),  # (3 + 1) / 2.5 = 1.6, rounded up
    (1.9, 8, 3),
    (1.1, 8, 4),
    (1.1, 2, 2),  # the ring's slots cap it
    (8.0, 8, 1),  # 0.5: the gather is done within one group's compute, and the next group is read ahead still
])
def test_the_lookahead_is_the_gather_and_copy_over_the_compute_per_group(compute_ms, cap, expected):
    ledger = TransferLedger()
    assert ledger.lookahead(cap) is None, "nothing measured yet"
    fed_ledger(ledger, 3.0, 1.0, compute_ms)
    assert ledger.lookahead(cap) == expected
    figures = ledger.as_dict()
    assert (figures["gather_ms_per_group"], figures["copy_ms_per_group"], figures["compute_ms_per_group"]) == \
        pytest.approx((3.0, 1.0, compute_ms))


@pytest.mark.parametrize("compute_ms, expected", [(8.0, 1), (2.5, 2), (0.5, 2)])  # (0.5: 8 groups, capped by the ring)
def test_the_disk_reads_ahead_as_many_groups_as_the_measured_rates_ask(tmp_path, checker, monkeypatch, compute_ms,
                                                                      expected):
    """With prefetch 1, a ledger whose gathers and copies take 1.6 times a group's compute reads two groups
    ahead of each gather, and one where they take half of it, one: the ``madvise`` calls after each gather
    name the next groups of the cycle, as many as the lookahead, which ``stats()`` shows. Bit-identical."""
    reference, offloaded, x = mapped_pair(tmp_path)
    handle = apply_group_offload(offloaded, offloaded.blocks, "cpu", prefetch=1, runtime=checker, host_budget=0)
    groups = len(handle.groups)
    assert handle.stats()["staging_bytes"] > 0 and groups == 6
    fed_ledger(handle.ledger, 3.0, 1.0, compute_ms)
    group_of = {view.data_ptr(): g.index for g in handle.groups for view in g.mirror.mapped_views()}
    mirrors = {id(g.mirror): g.index for g in handle.groups}
    log: list[tuple[str, int]] = []

    def advised(view: torch.Tensor) -> None:
        if log[-1] != ("ahead", group_of[view.data_ptr()]):
            log.append(("ahead", group_of[view.data_ptr()]))

    gather_into = InPlaceMirror.gather_into

    def gathered(mirror: InPlaceMirror, target: torch.Tensor, copy) -> int:
        log.append(("gather", mirrors[id(mirror)]))
        return gather_into(mirror, target, copy)

    monkeypatch.setattr(mirror_module, "advise_will_need", advised)
    monkeypatch.setattr(InPlaceMirror, "gather_into", gathered)
    with torch.inference_mode():
        expected_output = reference(x)
        assert torch.equal(offloaded(x), expected_output)  # (learns the order: nothing read ahead before it)
        log.clear()
        assert torch.equal(offloaded(x), expected_output)
    gathers = [i for i, (kind, _) in enumerate(log) if kind == "gather"]
    assert len(gathers) == groups
    for start, end in zip(gathers, gathers[1:] + [len(log)]):
        gathered_group = log[start][1]
        ahead = [index for _, index in log[start + 1 : end]]
        assert ahead == [(gathered_group + k) % groups for k in range(1, expected + 1)], log
    assert handle.stats()["read_ahead"] == expected
    handle.remove()


def mapped_group(path: Path, sizes: list[int], gaps: int = 0) -> tuple[list[torch.Tensor], InPlaceMirror, SourceFiles]:
    """Tensors of ``sizes`` bytes, ``gaps`` bytes apart in a file of random bytes out of the page cache, their
    views of its mapping, and an ``InPlaceMirror`` of them (with the ``SourceFiles`` it reads them through)."""
    path.write_bytes(random_bytes((sum(sizes) + gaps * (len(sizes) + 1),), torch.uint8, 7).numpy().tobytes())
    with open(path, "rb") as file:
        os.fsync(file.fileno())
        os.posix_fadvise(file.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    mapped, views, offset = map_file(path), [], gaps
    for size in sizes:
        views.append(mapped[offset : offset + size])
        offset += size + gaps
    segments, nbytes = pack_layout(views)
    sources = SourceFiles()
    return views, InPlaceMirror(segments, nbytes, views, FileMappings(), sources), sources


def test_past_the_bytes_kept_cached_a_gather_reads_around_the_page_cache(tmp_path: Path):
    """A group whose leading bytes stay cached, on a file system with direct reads: its bytes past ``cached_bytes``
    go from the disk to the target without entering the page cache; the leading ones are read through it and stay
    there. Bit-identical."""
    mib = 2**20
    sizes = [3 * mib, 5 * mib, 2 * mib]
    views, mirror, _sources = mapped_group(tmp_path / "group.bin", sizes)
    if not mirror.reads_around_cache:
        pytest.skip(f"the file system of {tmp_path} has no direct reads (O_DIRECT)")
    mirror.cached_bytes = 4 * mib + 100  # the first tensor, and a MiB and 100 bytes of the second
    target = torch.zeros(mirror.nbytes, dtype=torch.uint8)
    assert mirror.gather_into(target, lambda into, view: into.copy_(view)) == sum(sizes), "all from the disk"
    assert uncached_bytes(views[0]) == 0 and uncached_bytes(views[1][: mib + 100]) == 0, "the kept bytes are cached"
    assert uncached_bytes(views[1][2 * mib :]) == 3 * mib and uncached_bytes(views[2]) == sizes[2], \
        "the others never entered the page cache"
    assert all(torch.equal(into, view) for into, view in zip(segment_views(target, mirror.segments), views))


@pytest.mark.parametrize("kept", [0, 1, 4096 * 3 + 7, 10**9])
def test_reads_around_the_page_cache_are_bit_identical_at_any_offset(tmp_path: Path, monkeypatch, kept):
    """Direct reads in whole pages, a few pages at a time, of tensors at odd offsets and of odd sizes, from any
    byte kept cached on: each tensor's bytes exactly, none of its neighbours'."""
    from offload_core import hostmem

    monkeypatch.setattr(hostmem, "DIRECT_CHUNK", 2 * 4096)
    views, mirror, _sources = mapped_group(tmp_path / "group.bin", [5 * 4096 + 13, 1, 3 * 4096 - 5, 9000], gaps=333)
    if not mirror.reads_around_cache:
        pytest.skip(f"the file system of {tmp_path} has no direct reads (O_DIRECT)")
    mirror.cached_bytes = kept
    target = torch.full((mirror.nbytes,), 0xAB, dtype=torch.uint8)
    mirror.gather_into(target, lambda into, view: into.copy_(view))
    assert all(torch.equal(into, view) for into, view in zip(segment_views(target, mirror.segments), views))
    ends = [s.offset + s.nbytes for s in mirror.segments]
    padding = [target[end:start] for end, start in zip(ends, [s.offset for s in mirror.segments[1:]] + [mirror.nbytes])]
    assert all(bool((pad == 0xAB).all()) for pad in padding), "nothing written past a tensor"


@pytest.mark.parametrize("threads", [1, 2])
def test_host_copy_shares_the_reads_around_the_page_cache_among_its_threads(tmp_path: Path, threads):
    """Through ``HostCopy`` (a gather's on a CUDA device), a group's reads around the page cache go in pieces its
    threads share, cut at whole pages of the file past the bytes kept cached (no page read twice). Bit-identical."""
    from offload_core import hostmem

    views, mirror, _sources = mapped_group(tmp_path / "group.bin", [9 * 4096 + 13, 3, 5 * 4096 - 5], gaps=333)
    if not mirror.reads_around_cache:
        pytest.skip(f"the file system of {tmp_path} has no direct reads (O_DIRECT)")
    mirror.cached_bytes = 5000
    target = torch.full((mirror.nbytes,), 0xAB, dtype=torch.uint8)
    mirror.gather_into(target, HostCopy(threads))
    assert all(torch.equal(into, view) for into, view in zip(segment_views(target, mirror.segments), views))
    read = hostmem.FileRead(target[: views[0].numel()], views[0].data_ptr(), mirror._pages[0].direct, 333, 5000)
    pieces = [piece.args for piece in read.pieces(CHUNK) if piece.func is hostmem.read_direct]
    starts = [offset for _, offset, _, _ in pieces]
    ends = [offset + nbytes for _, offset, nbytes, _ in pieces]
    assert starts[0] == 333 + 5000 and ends[-1] == 333 + views[0].numel() and starts[1:] == ends[:-1]
    assert all(cut % 4096 == 0 for cut in starts[1:]) and max(e - s for s, e in zip(starts, ends)) <= CHUNK


def test_a_gather_releases_the_pages_past_the_bytes_kept_cached(tmp_path: Path, monkeypatch):
    """A group whose leading bytes stay cached, where its file has no direct reads: once it is copied, its
    pages past ``cached_bytes`` are released, the tensor the boundary falls in from the first page past it.
    Bit-identical."""
    from offload_core import hostmem
    from offload_core.hostmem import FilePages

    monkeypatch.setattr(hostmem, "open_direct", lambda descriptor: None)
    sizes = [3 * 4096, 5 * 4096, 2 * 4096]
    views, mirror, _sources = mapped_group(tmp_path / "group.bin", sizes)
    segments, nbytes = mirror.segments, mirror.nbytes
    mirror.cached_bytes = 4 * 4096 + 100  # the first tensor, and a page and 100 bytes of the second
    log: list[tuple[str, int, int]] = []
    index = {view.data_ptr(): i for i, view in enumerate(views)}
    monkeypatch.setattr(FilePages, "release", lambda pages, view, skip=0: log.append(("release", index[view.data_ptr()], skip)))

    def copy(target: torch.Tensor, source: torch.Tensor) -> None:
        log.append(("copy", index[source.data_ptr()], 0))
        target.copy_(source)

    target = torch.zeros(nbytes, dtype=torch.uint8)
    mirror.gather_into(target, copy)
    assert log == [("copy", 0, 0), ("copy", 1, 0), ("copy", 2, 0), ("release", 1, 4096 + 100), ("release", 2, 0)]
    assert all(torch.equal(into, view) for into, view in zip(segment_views(target, segments), views))
