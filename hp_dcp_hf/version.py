"""The package version, importable from every layer (the storage layer's user agent names it)."""

__version__ = "0.1.0"
