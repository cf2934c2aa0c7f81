"""The encoder-decoder diagram of notebook 05 names the three attentions and the sources of
their queries, keys and values."""

import matplotlib.pyplot as plt

from tutorial_lib.plotting import draw_encoder_decoder


def test_the_diagram_names_each_attention_with_its_q_k_v_sources_and_mask():
    ax = draw_encoder_decoder()
    texts = [t.get_text() for t in ax.texts]
    boxes = {name: next(t for t in texts if t.startswith(name))
             for name in ("encoder self-attention", "masked self-attention", "cross-attention")}
    assert "Q, K, V: source" in boxes["encoder self-attention"]
    assert "Q, K, V: target" in boxes["masked self-attention"] and "causal" in boxes["masked self-attention"]
    assert "Q: target" in boxes["cross-attention"] and "K, V: encoder output" in boxes["cross-attention"]
    assert "no causal mask" in boxes["cross-attention"]
    assert "three attentions" in ax.get_title()
    _, given = plt.subplots()
    assert draw_encoder_decoder(ax=given, title="mine") is given and given.get_title() == "mine"
