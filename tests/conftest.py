import os

import pytest


def shm_files_of(pids) -> list[str]:
    """ODC files in /dev/shm created by any of ``pids`` (file names carry the creator's pid)."""
    suffixes = tuple(f"_p{pid}.{ext}" for pid in pids for ext in ("seg", "lock"))
    return sorted(f for f in os.listdir("/dev/shm") if f.startswith("odc_") and f.endswith(suffixes))


@pytest.fixture
def pid_dir(tmp_path):
    d = tmp_path / "pids"
    d.mkdir()
    return d


def read_pids(pid_dir) -> list[int]:
    return [int(p.read_text()) for p in sorted(pid_dir.glob("rank*.pid"))]
