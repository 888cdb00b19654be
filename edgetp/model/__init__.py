"""Model math and files: GGUF reading, kernels, forward pass, tokenizers, sampling. No network.

Importing the package decides the kernels' instruction set (`isa.configure`), because
numba reads its compile target once, before the first kernel compiles. It never raises.
"""

from edgetp.model import isa as _isa

_isa.configure()
