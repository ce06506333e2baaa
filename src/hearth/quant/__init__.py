"""Leaf formats, maths only: MLX affine groups, CPU int8/int4 schemes, KV codecs."""
