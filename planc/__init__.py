"""planc: a compiler for distributed deep-learning training plans."""

__version__ = "0.1.0"
