"""The memory limits this process really has: its memory cgroup's (a container's: Docker, Kubernetes, RunPod),
at every level of the hierarchy above it, as Linux exposes them; and the host memory it may still take under all
of them and the RAM available (``host_room``).

A process in a container sees the whole machine's RAM in ``/proc/meminfo`` (and ``psutil``); what it may take
is the cgroup's limit less what the cgroup already charged. The page cache a cgroup charged counts as room:
the kernel reclaims it before it kills anything. Pure Python on Linux's files; elsewhere (or without a memory
cgroup with a limit) there is none.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

#: Where this process's cgroups and the kernel's mounts are listed.
PROC_CGROUP = Path("/proc/self/cgroup")
PROC_MOUNTINFO = Path("/proc/self/mountinfo")
PROC_MEMINFO = Path("/proc/meminfo")
#: At or past this, a v1 limit is "unlimited" (the kernel writes PAGE_COUNTER_MAX pages, rounded).
_UNLIMITED_V1 = 2**62


@dataclass(frozen=True)
class CgroupLimit:
    """One memory cgroup's limit on this process, and what it has charged."""

    name: str  # the limit's file, e.g. "cgroup v2 memory.max of /docker/abc"
    limit: int
    usage: int  # everything charged, page cache included
    cache: int  # of that, the file pages the kernel reclaims before it kills (active and inactive)

    @property
    def room(self) -> int:
        """What this process may still take before the cgroup kills it: its limit less what it charged
        that is not page cache."""
        return max(0, self.limit - (self.usage - self.cache))


def cgroup_limits(proc_cgroup: Path = PROC_CGROUP, mountinfo: Path = PROC_MOUNTINFO) -> list[CgroupLimit]:
    """The memory cgroups with a limit from this process's own up to the root of their hierarchy (a limit binds
    at every level), v2 or v1; none where Linux has no memory cgroup for it or it cannot be read."""
    try:
        lines = proc_cgroup.read_text().splitlines()
        mounts = _cgroup_mounts(mountinfo.read_text())
    except OSError:
        return []
    found: list[CgroupLimit] = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "" and "cgroup2" in mounts:
            found += _limits(mounts["cgroup2"], path, _read_v2)
        elif "memory" in controllers.split(",") and "memory" in mounts:
            found += _limits(mounts["memory"], path, _read_v1)
    return found


def host_room(meminfo: Path = PROC_MEMINFO) -> int | None:
    """The host memory this process may still take: the RAM available (``MemAvailable``) or a memory cgroup's
    room, whichever is least; None where Linux says neither."""
    rooms = [limit.room for limit in cgroup_limits()]
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                rooms.append(int(line.split()[1]) * 1024)  # (kB)
    except (OSError, ValueError):
        pass
    return min(rooms, default=None)


def _cgroup_mounts(mountinfo: str) -> dict[str, tuple[str, Path]]:
    """The v2 hierarchy's and the v1 memory controller's mounts: (the cgroup path mounted, where)."""
    mounts: dict[str, tuple[str, Path]] = {}
    for line in mountinfo.splitlines():
        fields = line.split()
        separator = fields.index("-")
        kind, options = fields[separator + 1], fields[separator + 3].split(",")
        if kind == "cgroup2":
            mounts.setdefault("cgroup2", (fields[3], Path(fields[4])))
        elif kind == "cgroup" and "memory" in options:
            mounts.setdefault("memory", (fields[3], Path(fields[4])))
    return mounts


def _limits(mount: tuple[str, Path], path: str, read) -> list[CgroupLimit]:
    """The limits of ``path``'s cgroup and its ancestors up to the mount (inside a container's cgroup namespace
    the mount is the container's own cgroup)."""
    root, where = mount
    relative = Path(path).relative_to(root) if Path(path).is_relative_to(root) else Path(path.lstrip("/"))
    limits = []
    for level in [relative, *relative.parents]:
        limit = read(where / level, "/" + ("" if level == Path(".") else str(level)))
        if limit is not None:
            limits.append(limit)
    return limits


def _stat(folder: Path) -> dict[str, int]:
    return {name: int(value) for name, value in (line.split() for line in (folder / "memory.stat").read_text()
                                                 .splitlines())}


def _read_v2(folder: Path, name: str) -> CgroupLimit | None:
    try:
        text = (folder / "memory.max").read_text().strip()
        if text == "max":
            return None
        stat = _stat(folder)
        return CgroupLimit(f"cgroup v2 memory.max of {name}", int(text), int((folder / "memory.current").read_text()),
                           stat.get("active_file", 0) + stat.get("inactive_file", 0))
    except (OSError, ValueError):
        return None


def _read_v1(folder: Path, name: str) -> CgroupLimit | None:
    try:
        limit = int((folder / "memory.limit_in_bytes").read_text())
        if limit >= _UNLIMITED_V1:
            return None
        stat = _stat(folder)
        return CgroupLimit(f"cgroup v1 memory.limit_in_bytes of {name}", limit,
                           int((folder / "memory.usage_in_bytes").read_text()),
                           stat.get("total_active_file", 0) + stat.get("total_inactive_file", 0))
    except (OSError, ValueError):
        return None
