"""Model tests run single-threaded: results must not depend on it, and the box has 2 cores."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread_and_seed():  # type: ignore[no-untyped-def]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    yield
    torch.set_num_threads(threads)
