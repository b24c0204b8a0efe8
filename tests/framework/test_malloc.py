"""phalanx.malloc: on glibc, a large block freed by one step is reused by the next instead of being
faulted in again page by page; malloc_trim gives it back. Run in a fresh interpreter (the
allocator settings are process-wide)."""
import json
import subprocess
import sys

import pytest

_PROBE = r"""
import json, resource, sys, torch
torch.set_num_threads(1)
from phalanx import malloc
kept = malloc.keep_freed_memory(enabled=sys.argv[1] == "on")
src = torch.ones(8 << 20)  # 32 MiB
def step():
    blocks = [torch.empty(8 << 20) for _ in range(3)]
    for b in blocks:
        b.copy_(src)
for _ in range(6):  # the heap settles in a few steps (small allocations land between the blocks)
    step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(4):
    step()
faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 4
def rss():
    return int(open("/proc/self/status").read().split("RssAnon:")[1].split()[0]) * 1024
held = rss()
malloc.give_back_freed_memory()
print(json.dumps({"kept": kept, "faults": faults, "held": held, "after_trim": rss()}))
"""


def _probe(mode: str) -> dict:
    out = subprocess.run([sys.executable, "-c", _PROBE, mode], capture_output=True, text=True, timeout=120,
                         env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"} | {k: v for k, v in __import__("os").environ.items()
                                                                             if k in ("PYTHONPATH", "HOME")})
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_freed_blocks_are_reused_not_faulted_in_again_and_trim_gives_them_back():
    off, on = _probe("off"), _probe("on")
    if not on["kept"]:
        pytest.skip("not glibc: phalanx.malloc leaves the allocator alone")
    page_faults_per_step = 3 * (32 << 20) / 4096  # three 32 MiB blocks, 4 KiB pages
    assert off["faults"] > 0.5 * page_faults_per_step, off   # glibc's default: mmap/munmap every block
    assert on["faults"] < 0.05 * page_faults_per_step, on     # kept: the next step reuses the pages
    # what is kept is a few times the step's 96 MiB at most (the heap settles with small
    # allocations between the blocks), and malloc_trim returns it
    assert on["held"] - off["held"] < 4 * (96 << 20), (on, off)
    assert on["held"] - on["after_trim"] > 64 << 20, on


_ORDER_PROBE = r"""
import json
from phalanx import malloc
follow = malloc.follow_live_memory()
keep_after = malloc.keep_freed_memory(enabled=True)   # what launch() does in a measuring rank
print(json.dumps({"follow": follow, "keep_after": keep_after, "setting": malloc._state["setting"]}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_a_measuring_process_keeps_following_live_memory():
    out = subprocess.run([sys.executable, "-c", _ORDER_PROBE], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    if not got["follow"]:
        pytest.skip("not glibc: phalanx.malloc leaves the allocator alone")
    assert got == {"follow": True, "keep_after": False, "setting": "follow"}, got


def test_phalanx_malloc_is_the_only_caller_of_mallopt():
    """One owner of glibc's thresholds: the settings live in `phalanx.malloc.SETTINGS`."""
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    callers = [str(p.relative_to(repo)) for top in ("framework", "tests", "bench", "apps")
               for p in sorted((repo / top).rglob("*.py"))
               if ".mallopt(" in p.read_text() and p != Path(__file__).resolve()]
    assert callers == ["framework/phalanx/malloc.py"], callers
