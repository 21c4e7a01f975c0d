"""Packed ("padding-free") forward passes for causal LMs, shared by the packing plugins: the packed layout
(`metadata`), the varlen attention and the attention registrations with transformers (`attention`), the fused varlen
kernels, their choice and their probe on the device (`kernels`, `probe`, `segments`), the glue around the model
(`glue`) and the packed positions announced around a packed call (`positions`).

This package imports nothing itself; import the submodule that owns a name. The submodules import torch (and
`attention` transformers), so plugins import them from their hooks modules only, never from their declarations.
"""
