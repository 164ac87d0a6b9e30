import json
import platform

import pytest

from hmi.allocator import tune_allocator


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_tune_allocator_applies_every_setting_on_glibc():
    assert tune_allocator() is True


def test_tune_allocator_can_be_turned_off(monkeypatch):
    monkeypatch.setenv("HMI_TUNE_MALLOC", "0")
    assert tune_allocator() is False


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_release_heap_returns_the_memory_the_tuned_allocator_keeps_after_a_load():
    import subprocess
    import sys

    probe = """
import json
from pathlib import Path
from hmi.allocator import release_heap, tune_allocator
import torch
anon = lambda: int(next(l for l in Path("/proc/self/status").read_text().splitlines() if l.startswith("RssAnon")).split()[1])
tune_allocator()
before = anon()
blocks = [torch.ones(1 << 20) for _ in range(256)]  # 1 GiB in 4 MiB tensors, as loading a root's weights leaves them
del blocks
kept = anon()
release_heap()
print(json.dumps({"before": before, "kept": kept, "after": anon()}))
"""
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    kib = json.loads(out.stdout)
    assert kib["kept"] - kib["before"] > 900 * 1024  # freed, but kept by the process
    assert kib["after"] - kib["before"] < 100 * 1024  # returned
