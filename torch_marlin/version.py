"""The package version (setup.py carries the same number), in a module of its own so that modules
recording it (checkpoints) need not import the package facade."""

__version__ = "0.1.0"
