"""elasticep_testkit.torch_threads: one thread inside the block, the count restored after
it, also when the block raises."""

import pytest
import torch

from elasticep_testkit.torch_threads import one_torch_thread


def test_one_thread_inside_and_the_count_restored_after():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with one_torch_thread():
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 2
        with pytest.raises(RuntimeError, match="inside"), one_torch_thread():
            raise RuntimeError("inside")
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
