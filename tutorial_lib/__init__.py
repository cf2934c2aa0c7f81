"""tutorial_lib: the finished parts of the Transformers-from-scratch notebooks.

Each module holds one idea; later notebooks import what earlier notebooks built.
"""

__version__ = "0.1.0"
