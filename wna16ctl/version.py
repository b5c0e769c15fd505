"""The version of wna16ctl, in a module of its own so that every layer can read it without
importing the package's API (which imports the layers)."""

__version__ = "0.1.0"
