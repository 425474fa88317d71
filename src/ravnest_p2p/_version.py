"""The package version, in a module of its own: modules that need it must not import the root package
(whose public API names every layer)."""

__version__ = "0.1.0"
