"""The label that carries no loss: one constant for the rows that write it and the losses that
read it.

`IGNORE_INDEX` (-100, as PyTorch's and Hugging Face's losses) marks a slot whose target is not
trained: a piece's last slot, padding, a token the loss mask leaves out. This module imports
nothing, so the row builder (`segpack.data.rows`, NumPy only) reads the constant without JAX.
"""

IGNORE_INDEX = -100
