"""The cap is a balloon: (total − cap) bytes held on the card, so that every allocator and every free-memory
query (ComfyUI's, comfy-aimdo's, the pack's ``auto``) sees a card of ``cap`` bytes; and the host's balloon, RAM
held by another process, so that ``MemAvailable`` is a smaller machine's."""
from __future__ import annotations

import gc
import re
import subprocess
import sys
from pathlib import Path

import torch


class Balloon:
    """Holds (total − cap) bytes of the card so that everyone sees a card of ``cap`` bytes."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._held: torch.Tensor | None = None

    def set_cap(self, cap: int | None) -> None:
        """Unload every model (ComfyUI loads again at the next run, planning against the new card)."""
        import comfy.model_management as mm

        self._held = None
        mm.unload_all_models()
        gc.collect()
        mm.soft_empty_cache(True)
        if self.device.type != "cuda":
            return
        torch.cuda.empty_cache()
        if cap is not None:
            total = torch.cuda.get_device_properties(self.device).total_memory
            self._held = torch.empty(max(0, total - cap), dtype=torch.uint8, device=self.device)


# The host side: a machine with less RAM than this one ---------------------------------------------

_HOLD = """
import ctypes, mmap, os, sys, time
size, lock = int(sys.argv[1]), sys.argv[2] == "1"
held = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0))
for offset in range(0, size, 4096):  # touched: every page is the balloon's, whatever MAP_POPULATE did
    held[offset] = 1
address = ctypes.addressof(ctypes.c_char.from_buffer(held))
if lock and ctypes.CDLL(None, use_errno=True).mlock(ctypes.c_void_p(address), ctypes.c_size_t(size)):
    sys.exit("mlock failed: errno %d" % ctypes.get_errno())
print("held", flush=True)
parent = os.getppid()
while os.getppid() == parent:  # until the benchmark's process ends, however it ends
    time.sleep(0.5)
"""


def swap_in_use() -> bool:
    """Whether /proc/swaps lists any swap (then a balloon's anonymous pages could be swapped out)."""
    swaps = Path("/proc/swaps")
    return swaps.exists() and len(swaps.read_text().splitlines()) > 1


def mem_available() -> int:
    return int(re.search(r"MemAvailable:\s+(\d+) kB", Path("/proc/meminfo").read_text()).group(1)) * 1024


class HostBalloon:
    """A process that holds RAM so that ``MemAvailable`` is what a smaller machine has: touched anonymous memory
    where no swap is configured, page-locked memory (``mlock``) where some is. It ends with this process."""

    def __init__(self) -> None:
        self._process: subprocess.Popen | None = None

    def hold_to_leave(self, available: int) -> int:
        """Hold what it takes to leave ``available`` bytes; returns the bytes held."""
        self.release()
        size = max(0, mem_available() - available)
        if size:
            self._process = subprocess.Popen([sys.executable, "-c", _HOLD, str(size), "1" if swap_in_use() else "0"],
                                             stdout=subprocess.PIPE, text=True)
            if self._process.stdout.readline().strip() != "held":
                raise RuntimeError(f"the host balloon could not hold {size / 1e9:.1f} GB (exit {self._process.wait()})")
        return size

    def release(self) -> None:
        if self._process is not None:
            self._process.kill()
            self._process.wait()
            self._process = None
