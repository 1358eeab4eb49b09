"""The KV-cache buffer pool: ranges come back when their last view dies, neighbours merge, and sampling with
the pool gives what sampling from the heap gives."""

from __future__ import annotations

import gc
import mmap
import os
from pathlib import Path

import pytest
import torch

from contrail.agent import HFBackend, SamplingParams
from contrail.agent.buffer_pool import ALIGN, MADV_POPULATE_WRITE, BufferPool, empty, pool, pooling
from contrail.testing import tiny_model

PAGE_OF_BF16 = (ALIGN // 2,)  # one page of bf16 elements


def test_a_range_is_reused_only_once_the_last_tensor_viewing_it_is_gone():
    buffers = BufferPool(16 * ALIGN)
    first = buffers.empty((4, 1024), torch.bfloat16)
    address = first.data_ptr()
    view = first[:, :10]
    del first
    gc.collect()
    assert buffers.empty(PAGE_OF_BF16, torch.bfloat16).data_ptr() != address  # the view still holds it
    del view
    assert buffers.empty((4, 1024), torch.bfloat16).data_ptr() == address


def test_freed_neighbours_merge_into_one_range_that_a_larger_buffer_fits():
    buffers = BufferPool(8 * ALIGN)
    a, b, c = (buffers.empty(PAGE_OF_BF16, torch.bfloat16) for _ in range(3))
    start, top = a.data_ptr(), buffers.high_water
    del b, a  # freed in reverse order: merged either way
    merged = buffers.empty((ALIGN,), torch.bfloat16)  # two pages
    assert merged.data_ptr() == start and buffers.high_water == top  # below c: the pool did not grow
    del merged, c
    assert buffers.free_bytes() == buffers.capacity


def test_a_buffer_holds_its_shape_dtype_and_values_and_views_write_into_it():
    buffers = BufferPool(64 * ALIGN)
    keys = buffers.empty((2, 3, 5, 8), torch.float32)
    assert keys.shape == (2, 3, 5, 8) and keys.dtype == torch.float32 and keys.is_contiguous()
    assert keys.data_ptr() % ALIGN == 0
    keys.fill_(0)
    keys[:, :, :2] = 1.5
    assert keys.sum().item() == 1.5 * 2 * 3 * 2 * 8


def _vm_flags(address: int) -> list[str]:
    """The kernel's flags for the mapping holding ``address`` (``/proc/self/smaps``)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text(errors="replace").splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            low, high = (int(end, 16) for end in head.split("-"))
            inside = low <= address < high
        elif inside and head == "VmFlags:":
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.skipif(not hasattr(mmap, "MADV_HUGEPAGE") or not os.path.isdir("/sys/kernel/mm/transparent_hugepage"),
                    reason="a Linux kernel with transparent huge pages")
@pytest.mark.parametrize("huge_pages", [True, False])
def test_the_pool_asks_for_huge_pages_only_when_told(huge_pages):
    buffers = BufferPool(64 * ALIGN, huge_pages=huge_pages)
    first = buffers.empty(PAGE_OF_BF16, torch.bfloat16)
    assert buffers.huge_pages == huge_pages
    assert ("hg" in _vm_flags(first.data_ptr())) == huge_pages  # the kernel's mark of MADV_HUGEPAGE


HAS_MINCORE = BufferPool(ALIGN).resident_bytes() is not None
needs_mincore = pytest.mark.skipif(not HAS_MINCORE, reason="no mincore here")


def _a_live_and_a_freed_buffer() -> tuple[BufferPool, torch.Tensor]:
    """A pool of 64 MiB whose first 16 MiB buffer lives (all ones) and whose second, the same size, was freed."""
    buffers = BufferPool(64 << 20)
    live = buffers.empty((4 << 20,), torch.float32)
    live.fill_(1.0)
    freed = buffers.empty((4 << 20,), torch.float32)
    freed.fill_(2.0)
    assert buffers.resident_bytes() == 32 << 20
    del freed
    gc.collect()
    return buffers, live


@needs_mincore
def test_release_hands_back_the_free_ranges_pages_and_keeps_the_live_buffers():
    buffers, live = _a_live_and_a_freed_buffer()
    assert buffers.resident_bytes() == 32 << 20  # freed, but its pages still held
    assert buffers.release() == 16 << 20
    assert buffers.resident_bytes() == 16 << 20
    assert bool((live == 1.0).all())
    again = buffers.empty((4 << 20,), torch.float32)  # the freed range, its pages fresh from the kernel
    assert float(again.abs().sum()) == 0.0


def _kernel_populates() -> bool:
    """Whether this kernel backs a range on ``MADV_POPULATE_WRITE`` (Linux >= 5.14), asked without the pool."""
    if MADV_POPULATE_WRITE is None:
        return False
    with mmap.mmap(-1, ALIGN, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS) as memory:
        try:
            memory.madvise(MADV_POPULATE_WRITE, 0, ALIGN)
        except OSError:
            return False
    return True


needs_populate = pytest.mark.skipif(not (HAS_MINCORE and _kernel_populates()),
                                    reason="no mincore or MADV_POPULATE_WRITE here")


@needs_populate
def test_refill_backs_what_the_released_phase_reached_and_no_further():
    buffers, live = _a_live_and_a_freed_buffer()
    buffers.release()
    assert buffers.resident_bytes() == 16 << 20
    assert buffers.refill() == 16 << 20  # the freed buffer's range: the phase reached 32 MiB
    assert buffers.resident_bytes() == 32 << 20  # and not the untouched 32 MiB beyond it
    assert buffers.refill() == 0  # once per release
    assert bool((live == 1.0).all())
    again = buffers.empty((4 << 20,), torch.float32)  # the refilled range: zeros, not the freed buffer's values
    assert float(again.abs().sum()) == 0.0


@needs_populate
def test_refill_targets_what_the_last_phase_used_not_what_was_refilled_for_it():
    buffers = BufferPool(64 << 20)

    def phase(floats: int) -> None:  # a phase that needs one buffer of ``floats`` float32 values
        buffer = buffers.empty((floats,), torch.float32)
        del buffer
        gc.collect()

    phase(8 << 20)  # 32 MiB: an evaluation, say
    buffers.release()
    assert buffers.refill() == 32 << 20
    phase(2 << 20)  # 8 MiB: the next phase needs less
    buffers.release()
    assert buffers.resident_bytes() == 0  # the 24 MiB refilled and never used go back too
    assert buffers.refill() == 8 << 20
    phase(4 << 20)
    buffers.release()
    phase(2 << 20)
    buffers.release()
    assert buffers.refill() == 16 << 20  # two releases without a refill between: the larger phase


@needs_mincore
def test_before_an_update_the_backend_hands_its_cache_pages_back(tokenizer):
    model = tiny_model(tokenizer, seed=3)
    prompts = [tokenizer("say the word . " * (8 + i))["input_ids"] for i in range(6)]
    with pooling(BufferPool(1 << 30)) as buffers:
        backend = HFBackend(model, frozenset(), tokenizer.pad_token_id, seed=5)
        backend.generate(prompts, SamplingParams(max_new_tokens=4, temperature=1.0))
        assert buffers.resident_bytes() > 0  # the kept cache, and the turn's freed ones
        backend.prepare_update()
        assert buffers.resident_bytes() == 0  # the kept cache dropped, every page back with the kernel


def test_after_an_update_the_backend_hands_the_heap_s_freed_pages_back_then_refills_the_pool(tokenizer,
                                                                                         monkeypatch):
    calls = []
    monkeypatch.setattr("contrail.agent.backend.hand_back_freed_memory", lambda: calls.append("trim") or True)
    monkeypatch.setattr("contrail.agent.backend.refill_released_pages", lambda: calls.append("refill") or 0)
    backend = HFBackend(tiny_model(tokenizer, seed=3), frozenset(), tokenizer.pad_token_id)
    backend.sync_weights()
    assert calls == ["trim", "refill"]  # the heap's pages first, so the pool's come from them


def test_decode_attention_reads_a_pooled_cache_buffer_whole_in_place():
    from contrail.agent.attention import whole_buffers

    buffers = BufferPool(64 * ALIGN)
    keys, values = (buffers.empty((2, 3, 40, 8), torch.bfloat16) for _ in range(2))
    assert keys._base is None  # not a view of the pool's flat memory: its views' ``_base`` is the buffer
    mask = torch.ones(2, 1, 1, 30, dtype=torch.bool)
    whole_keys, whole_values, widened = whole_buffers(keys[..., :30, :], values[..., :30, :], mask)
    assert whole_keys.data_ptr() == keys.data_ptr() and whole_keys.shape == keys.shape
    assert whole_values.shape == values.shape and widened.shape[-1] == 40 and not widened[..., 30:].any()


def test_a_request_the_pool_cannot_fit_comes_from_the_heap():
    with pooling(BufferPool(2 * ALIGN)) as buffers:
        held = empty(torch.zeros(1, dtype=torch.bfloat16), (ALIGN,))  # two pages: the whole pool
        spilled = empty(torch.zeros(1, dtype=torch.bfloat16), (4, ALIGN))
        assert buffers.empty(PAGE_OF_BF16, torch.bfloat16) is None
        assert spilled.shape == (4, ALIGN) and buffers.free_bytes() == 0
    del held
    assert pool() is None  # outside the block: this test process does not keep freed memory


@pytest.mark.parametrize("share_prefix", [True, False])
def test_sampling_with_the_pool_matches_the_heap_and_returns_every_range(tokenizer, share_prefix):
    model = tiny_model(tokenizer, seed=3)
    instructions = "you play a word game . " * 12
    prompts = [tokenizer(instructions + rest)["input_ids"] for rest in
               ("go .", "say the word . " * 30, "go on .", "say . " * 20, "go .")]
    params = SamplingParams(max_new_tokens=6, temperature=1.0)
    stop = frozenset({tokenizer.convert_tokens_to_ids(".")})  # rows stop at different steps: some are parked

    def two_turns(backend):
        first = backend.generate(prompts, params)
        follow = [p + g.ids + tokenizer(" ok . " * (i + 1))["input_ids"] for i, (p, g) in
                  enumerate(zip(prompts, first))]
        return first + backend.generate(follow, params)

    with pooling(None):
        plain = two_turns(HFBackend(model, stop, tokenizer.pad_token_id, seed=5, share_prefix=share_prefix))
    with pooling(BufferPool(1 << 30)) as buffers:
        backend = HFBackend(model, stop, tokenizer.pad_token_id, seed=5, share_prefix=share_prefix)
        pooled = two_turns(backend)
        assert buffers.high_water > 0  # the caches lived in the pool
        backend.reset_cache()
        del backend
        gc.collect()
        assert buffers.free_bytes() == buffers.capacity  # and every range came back
    assert [g.ids for g in pooled] == [g.ids for g in plain]
    for a, b in zip(pooled, plain):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
