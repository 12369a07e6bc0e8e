"""Wire codecs for tensors that cross a pipeline cut (activations forward, gradients back): a table
of codecs from bf16 to int4 and low rank, each with an exact payload size, an error bound and a
roofline price; fused Triton kernels run them on GPUs."""

from hetcc.wire.codecs import CODECS, MIN_CODED_ELEMENTS, NO_CODEC, Codec, get_codec, within_budget

__all__ = ["CODECS", "MIN_CODED_ELEMENTS", "NO_CODEC", "Codec", "get_codec", "within_budget"]
