"""SliceGPT (Ashkboos et al., 2024): a whole-model method that rotates the residual stream and slices it."""
from spap_lib.methods.slicegpt.method import SliceGPT
from spap_lib.methods.slicegpt.slicing import SLICED_FORMAT  # its checkpoints' loader, registered on import

__all__ = ["SLICED_FORMAT", "SliceGPT"]
