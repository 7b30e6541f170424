import os

import pytest
import torch

# fresh random inputs each session, but reproducible when a failure is reported
SEED = int(os.environ.get("ATTENTION_EXT_TEST_SEED", torch.randint(0, 2**31 - 1, (1,)).item()))


def pytest_report_header(config):
    return f"attention_ext test seed: ATTENTION_EXT_TEST_SEED={SEED}"


@pytest.fixture(autouse=True)
def _seed(request):
    torch.manual_seed(SEED + hash(request.node.nodeid) % 100003)
    yield
