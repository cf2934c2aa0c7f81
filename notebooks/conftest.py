"""Notebooks under pytest (nbval) never use the network.

Notebook 09 loads real weights from the Hugging Face Hub when it can reach it; under test it
must take its offline path (tiny checkpoints made on the spot) on every machine, so that the
run is the same everywhere and downloads nothing. The kernels nbval starts inherit this
environment, and ``tutorial_lib.pretrained.hub_reachable`` answers False when it is set.
"""

import os

os.environ["HF_HUB_OFFLINE"] = "1"
