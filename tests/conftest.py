import os
import sys

import pytest
import torch

# Tests run against the installed package (pip install -e .); make a source checkout importable too.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: real-model tests that take minutes on 2 cores (deselect with -m 'not slow')")
    config.addinivalue_line("markers", "metal_emu: the Metal kernels in the Metal-on-CPU harness (tests/backends.py; "
                                       "deselect with -m 'not metal_emu')")
