"""The per-step counter of `python -m bench syncs` (bench/trace/syncs.py) sorts what a step
dispatches as a GPU runs it: a read of a value to the host (`.item()`, `bool()` of a tensor, a
boolean-mask index, `.tolist()`) is a sync, a view or an allocation launches nothing, every other
op is one kernel; nothing is counted outside its window."""

import torch

from bench.trace.syncs import _host_read, counting_mode


def test_host_reads_are_syncs_views_launch_nothing_and_other_ops_are_kernels():
    x = torch.arange(16.0).reshape(4, 4)
    mode = counting_mode()
    with mode:
        mode.active = True
        y = x + 1
        flat = y.view(16)
        picked = y[y > 8]
        total = float(y.sum())
        if (flat > 100).any():  # bool() of a tensor: the host waits for the value
            pass
        mode.active = False
        y * 2  # outside the window
    assert total == 136.0 and picked.numel() == 8
    assert dict(mode.syncs) == {"aten.index.Tensor": 1, "aten._local_scalar_dense.default": 2}
    assert dict(mode.kernels) == {
        "aten.add.Tensor": 1,
        "aten.gt.Scalar": 2,
        "aten.sum.default": 1,
        "aten.any.default": 1,
    }


def test_tolist_in_the_window_is_a_sync():
    mode = counting_mode()
    tolist = _host_read(torch.Tensor.tolist, "Tensor.tolist", mode)
    t = torch.tensor([1, 2])
    assert tolist(t) == [1, 2] and not mode.syncs
    mode.active = True
    assert tolist(t) == [1, 2]
    assert dict(mode.syncs) == {"Tensor.tolist": 1}
