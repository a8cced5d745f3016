"""The package version: one place, read by the package, the plan cache keys and the build."""

__version__ = "0.1.0"
