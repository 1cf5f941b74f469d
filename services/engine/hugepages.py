"""A CPU model's quantised weights on 2 MiB pages (`to_huge_pages`).

A decode step reads every weight once. The int4 kernel streams its codes at about 22 GB/s on
4 KiB pages, where each page costs the core a TLB miss and the hardware prefetcher stops at
its end; one row through copies of a 1536 x 8960 int4 layer took 0.378 ms on 4 KiB pages and
0.345 ms with about a third of the codes on 2 MiB pages (2 threads, Xeon with AVX512-VNNI),
and with all of them the default target decoded at 22.95 against 19.57 tokens/s.
Linux gives an anonymous mapping transparent huge pages where the process asks for them
(`madvise(MADV_HUGEPAGE)`, the kernel's default mode "madvise") before its pages are touched,
in whole 2 MiB-aligned runs: a tensor on its own gets only the aligned part in its middle, so
every quantised buffer moves into one arena, aligned, asked for before it is filled. Tensors
that share a storage (a joined layer's rows, viewed by the layers it joined) keep sharing it.
Where the kernel refuses (THP "never", not Linux) the weights stay where they are.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
from pathlib import Path

import torch
from torch import nn

log = logging.getLogger(__name__)

PAGE = 2 << 20
MADV_HUGEPAGE = 14  # <sys/mman.h>
# Each storage starts a 4 KiB page of the arena, as each started a page of its own allocation
# before: packed at 64-byte offsets, the 17-token tree step and prompt chunks took 7-8% longer
# (the kernel's code and activation loads then fall on the same 4 KiB offsets more often).
ALIGN = 4096
BUFFERS = ("packed", "scale_offset", "codes", "scales")  # quantised layers' (quant.py)
SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def available() -> bool:
    """Whether this kernel gives huge pages to a mapping that asks ("always" or "madvise")."""
    try:
        return "[never]" not in SETTING.read_text()
    except OSError:
        return False


def _advise(address: int, length: int) -> bool:
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc.madvise(address, length, MADV_HUGEPAGE) == 0


@torch.no_grad()
def to_huge_pages(modules: list[nn.Module]) -> int:
    """Moves the CPU buffers named BUFFERS of `modules` into one arena on huge pages (each
    tensor keeps its shape, strides and dtype, and tensors that shared a storage still share
    one); returns the bytes moved, 0 where huge pages are not available."""
    found = {
        id(t): t
        for m in modules
        for name in BUFFERS
        if isinstance(t := getattr(m, name, None), torch.Tensor) and t.device.type == "cpu"
    }
    tensors = list(found.values())
    storages: dict[int, torch.UntypedStorage] = {}
    for t in tensors:
        storages.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage())
    total = sum(-(-s.nbytes() // ALIGN) * ALIGN for s in storages.values())
    if not total or not available():
        return 0
    pages = -(-total // PAGE) * PAGE  # (whole pages, all inside the allocation)
    raw = torch.empty(pages + PAGE, dtype=torch.uint8)
    start = -raw.data_ptr() % PAGE
    if not _advise(raw.data_ptr() + start, pages):
        log.info("huge pages refused (madvise failed): quantised weights stay on small pages")
        return 0
    arena = raw.untyped_storage()
    at: dict[int, int] = {}  # storage address -> its byte offset in the arena
    offset = start
    for address, storage in storages.items():
        source = torch.empty(0, dtype=torch.uint8).set_(storage)
        raw[offset : offset + storage.nbytes()].copy_(source)
        at[address] = offset
        offset += -(-storage.nbytes() // ALIGN) * ALIGN
    for t in tensors:
        byte = at[t.untyped_storage().data_ptr()] + t.storage_offset() * t.element_size()
        t.set_(arena, byte // t.element_size(), t.size(), t.stride())
    return total
