import platform

import pytest

from hmi.allocator import tune_allocator


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_tune_allocator_applies_every_setting_on_glibc():
    assert tune_allocator() is True


def test_tune_allocator_can_be_turned_off(monkeypatch):
    monkeypatch.setenv("HMI_TUNE_MALLOC", "0")
    assert tune_allocator() is False
