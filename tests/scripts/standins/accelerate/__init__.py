"""A stand-in for Hugging Face Accelerate, as far as its process-wide state goes: the launch
must recognise ``accelerate.state`` by name (the real package is not a test dependency)."""

from .accelerator import Accelerator

__all__ = ["Accelerator"]
