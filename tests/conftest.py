import os
import sys
from pathlib import Path

# Triton kernels run through its CPU interpreter in tests; this must be set before triton is imported.
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HETCC_CHECK", "1")  # hetcc.verify's invariant checks after every pass
sys.path.insert(0, str(Path(__file__).parent))
