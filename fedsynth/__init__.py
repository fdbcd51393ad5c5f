"""fedsynth: the shared library that every fedsynth process (coordinator, client node, generator) imports."""

__version__ = "0.1.0"
