"""The package's version: a leaf module, so that any layer can name it without importing
the package's public names."""

__version__ = "0.1.0"
