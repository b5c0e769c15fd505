import pytest
import torch


@pytest.fixture(autouse=True)
def _single_thread():
    """Layout tests use small tensors, where thread start-up and barriers cost more than the work
    (much more on a busy machine); one thread keeps them fast and their timing steady."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
