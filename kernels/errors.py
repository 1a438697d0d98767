"""KernelArgumentError: the one error type of the kernels package.

The kernels know nothing of commands or exit codes; a caller that faces a user
(the CLI) decides what a bad kernel argument means there.
"""


class KernelArgumentError(ValueError):
    """Arguments to a kernel whose dtype, rank, shape, layout or tiling do not fit."""
