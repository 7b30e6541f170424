import os

import pytest
import torch

# fresh random inputs each session, but reproducible when a failure is reported
SEED = int(os.environ.get("ATTENTION_EXT_TEST_SEED", torch.randint(0, 2**31 - 1, (1,)).item()))

# ATTENTION_EXT_LINEAR_STANDIN=1: the linear ops from reference.py where the extension lacks them
# (defined before attention_ext is imported: its ops.py reads the registry at import)
if os.environ.get("ATTENTION_EXT_LINEAR_STANDIN") == "1":
    from tests.linear import standin

    standin.define_ops()


def pytest_report_header(config):
    return f"attention_ext test seed: ATTENTION_EXT_TEST_SEED={SEED}"


@pytest.fixture(autouse=True)
def _seed(request):
    torch.manual_seed(SEED + hash(request.node.nodeid) % 100003)
    yield
