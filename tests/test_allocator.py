"""malloc keeping freed memory (`contrail.allocator`), and the ``contrail`` command asking for it."""

import json
import os
import platform
import subprocess
import sys

import pytest

import contrail.allocator as allocator
import contrail.cli as cli

needs_glibc = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")

# Allocates a 64 MiB block, touches every page, frees it, then does it again and counts the page faults of the
# second round: the kernel's fresh pages, or the first block's, reused.
REUSE = """
import ctypes, json, resource, sys
import contrail.allocator as allocator
kept = allocator.keep_freed_memory() if sys.argv[1] == "keep" else False
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
size = 64 << 20
def round_trip():
    block = libc.malloc(size)
    libc.memset(block, 1, size)
    libc.free(block)
round_trip()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
round_trip()
print(json.dumps({"kept": kept, "faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before}))
"""


def second_round(mode: str, **env: str) -> dict:
    clean = {k: v for k, v in os.environ.items() if k != allocator.OPT_OUT and k not in allocator.GLIBC_SETTINGS}
    done = subprocess.run([sys.executable, "-c", REUSE, mode], env={**clean, **env}, capture_output=True, text=True,
                          check=True)
    return json.loads(done.stdout)


@needs_glibc
def test_kept_memory_is_reused_without_page_faults_where_the_system_malloc_faults_it_in_again():
    pages = (64 << 20) // os.sysconf("SC_PAGE_SIZE")
    system, kept = second_round("system"), second_round("keep")
    assert not system["kept"] and system["faults"] > pages // 2  # the block went back to the kernel
    assert kept["kept"] and kept["faults"] < pages // 20


@needs_glibc
@pytest.mark.parametrize("env", [{"CONTRAIL_MALLOC": "system"}, {"MALLOC_TRIM_THRESHOLD_": "131072"},
                                 {"GLIBC_TUNABLES": "glibc.malloc.mmap_max=1"}])
def test_the_opt_out_and_the_user_s_own_malloc_settings_leave_malloc_as_it_is(env):
    result = second_round("keep", **env)
    assert not result["kept"] and result["faults"] > (64 << 20) // os.sysconf("SC_PAGE_SIZE") // 2


# Keeping freed memory, frees a touched 64 MiB block, then reads the resident set before and after handing the
# heap's free pages back (or not).
HAND_BACK = """
import ctypes, json, os, sys
import contrail.allocator as allocator
allocator.keep_freed_memory()
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
def resident():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
block = libc.malloc(64 << 20)
libc.memset(block, 1, 64 << 20)
libc.free(block)
before = resident()
handed = allocator.hand_back_freed_memory() if sys.argv[1] == "hand back" else False
print(json.dumps({"handed": handed, "dropped": before - resident()}))
"""


@needs_glibc
@pytest.mark.parametrize("mode", ["hand back", "keep"])
def test_handing_back_returns_the_kept_heap_s_free_pages_to_the_kernel(mode):
    clean = {k: v for k, v in os.environ.items() if k != allocator.OPT_OUT and k not in allocator.GLIBC_SETTINGS}
    done = subprocess.run([sys.executable, "-c", HAND_BACK, mode], env=clean, capture_output=True, text=True,
                          check=True)
    result = json.loads(done.stdout)
    if mode == "keep":
        assert result["dropped"] < 8 << 20  # kept: the freed block's pages stay resident
    else:
        assert result["handed"] and result["dropped"] > 56 << 20


def test_a_c_library_without_mallopt_is_left_alone(monkeypatch):
    monkeypatch.setattr(allocator, "_glibc", lambda: None)
    monkeypatch.delenv(allocator.OPT_OUT, raising=False)
    assert allocator.keep_freed_memory() is False


def test_the_contrail_command_keeps_freed_memory_before_it_runs_anything(monkeypatch, capsys):
    calls = []
    monkeypatch.setattr(cli, "keep_freed_memory", lambda: calls.append("kept"))
    monkeypatch.setattr(cli, "cmd_envs", lambda args: calls.append("envs") or 0)
    assert cli.main(["envs"]) == 0
    assert calls == ["kept", "envs"]
