"""fedsynth: the shared library that every fedsynth process (coordinator, client node, generator) imports."""

__version__ = "0.2.0"
