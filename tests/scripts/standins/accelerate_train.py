"""A script that uses (a stand-in of) Accelerate. See tests/scripts/standins/accelerate."""

from accelerate import Accelerator

accelerator = Accelerator()
print(f"process index {accelerator.process_index}")
