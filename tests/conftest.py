import os

import matplotlib
import pytest
import torch

matplotlib.use("Agg")  # tests draw figures without a screen
os.environ.setdefault("PYTHONHASHSEED", "0")


@pytest.fixture(autouse=True)
def _seed_and_close_figures():
    torch.manual_seed(0)
    yield
    import matplotlib.pyplot as plt

    plt.close("all")


@pytest.fixture
def id_value_checks(monkeypatch):
    """record(*modules) -> a list that receives, for every call of check_id_values in those
    modules (the one host sync of a forward pass), the names of the tensors it checked."""
    calls = []

    def record(*modules):
        for module in modules:
            def check(*ranges, original=module.check_id_values):
                calls.append([r.name for r in ranges])
                return original(*ranges)

            monkeypatch.setattr(module, "check_id_values", check)
        return calls

    return record
