"""Pool tensors on huge pages: zeroed, 2 MiB-aligned, alive as long as the tensor."""
import gc

import pytest
import torch

from baton.shared.kv.host_memory import HUGE_PAGE, huge_page_zeros

from test_kv_store import make_store

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.uint8])
def test_huge_page_zeros_is_a_zeroed_aligned_tensor(dtype):
    t = huge_page_zeros((3, 5, 7), dtype)
    gc.collect()  # the mapping lives as long as the tensor
    assert t.shape == (3, 5, 7) and t.dtype == dtype and t.is_contiguous()
    assert t.data_ptr() % HUGE_PAGE == 0 and not t.any()
    t += 1
    assert t.sum().item() == 3 * 5 * 7
    assert huge_page_zeros((0, 4), dtype).shape == (0, 4)


def test_store_pools_are_huge_page_aligned():
    store = make_store("ring")
    for tensor in [*store.data.values(), store.aux]:
        assert tensor.data_ptr() % HUGE_PAGE == 0 and not tensor.any()
