import os
import sys

import pytest
import torch

# Tests run against the installed package (pip install -e .); make a source checkout importable too.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
