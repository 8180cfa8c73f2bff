"""The package's version, importable from every layer (the codecs write it into each container)."""

__version__ = "0.1.0"
