"""A stand-in for Hugging Face Accelerate, as far as its process-wide state goes: the launch
recognises ``accelerate.state`` by name and makes its state per rank (the real package is not
a test dependency)."""

from .accelerator import Accelerator

__all__ = ["Accelerator"]
