"""model/layers.py KVBuffer, the decode cache's growing K/V: what torch.cat would hold, without a copy per token."""
import torch

from model.layers import KVBuffer


def test_appends_hold_what_cat_would_and_copy_the_context_once_per_block():
    """A 100-position prefill, then 600 single positions, along dim 2 of [B, H, T, D]: the filled part equals
    torch.cat of the appends after each one; the storage is reallocated only when the length passes a multiple
    of BLOCK (256): 100 -> 256, 257 -> 512, 513 -> 768, three storages in all. A prefill of a whole number of blocks
    leaves room for the next token."""
    g = torch.Generator().manual_seed(0)
    buffer, parts, storages = KVBuffer(dim=2), [], set()
    for n in [100] + [1] * 600:
        parts.append(torch.randn(2, 3, n, 4, generator=g))
        filled = buffer.append(parts[-1])
        storages.add(buffer.storage.data_ptr())
        assert filled.data_ptr() == buffer.storage.data_ptr()  # a view, not a copy
    torch.testing.assert_close(filled, torch.cat(parts, 2), rtol=0, atol=0)
    assert len(storages) == 3 and buffer.storage.shape[2] == 768 and buffer.length == 700
    assert buffer.nbytes() == 2 * 3 * 700 * 4 * 4  # the filled part's fp32 bytes, not the reserved 768
    whole = KVBuffer(dim=2)
    whole.append(torch.zeros(1, 1, 512, 2))
    assert whole.storage.shape[2] == 768


def test_reorder_moves_rows_and_appends_go_on_after_it():
    """Beam search's reorder (a row dropped, one repeated), along dim 1 of [B, T, H, D] (DSA's layout)."""
    g = torch.Generator().manual_seed(1)
    first, second = torch.randn(3, 5, 2, 4, generator=g), torch.randn(3, 2, 2, 4, generator=g)
    buffer = KVBuffer(dim=1)
    buffer.append(first)
    rows = torch.tensor([2, 0, 0])
    buffer.reorder(rows)
    torch.testing.assert_close(buffer.append(second), torch.cat([first[rows], second], 1), rtol=0, atol=0)


def test_a_cache_carries_no_gradient():
    x = torch.randn(1, 1, 3, 2, requires_grad=True)
    assert not KVBuffer(dim=2).append(x * 2).requires_grad
