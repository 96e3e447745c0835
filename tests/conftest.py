import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
torch.set_num_threads(1)  # tiny models: one thread avoids oversubscription stalls on small CPUs

from helpers import tiny_target  # noqa: E402


@pytest.fixture(scope="session")
def tiny_llama():
    return tiny_target("llama")


@pytest.fixture(scope="session")
def tiny_qwen3():
    return tiny_target("qwen3")
