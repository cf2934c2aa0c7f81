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
