"""Model math and files: GGUF reading, kernels, forward pass, tokenizers, sampling. No network.

Importing the package decides where numba caches the kernels (`jitcache.configure`: a
folder per version of their source, before any kernel is decorated) and their instruction
set (`isa.configure`), because numba reads its compile target once, before the first kernel
compiles. Neither raises. Then numba's cache saves take a lock between processes
(`jitcache.lock_saves`).
"""

from edgetp.model import isa as _isa
from edgetp.model import jitcache as _jitcache

_jitcache.configure()
_isa.configure()
_jitcache.lock_saves()  # numba loads here, its cache folder and target set
