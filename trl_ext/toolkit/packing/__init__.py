"""Packed ("padding-free") forward passes for causal LMs, shared by the packing plugins.

- `metadata`: how a padded batch maps to one packed row (`PackInfo`, `packing_metadata`, `pack_rows`, `unpack_rows`,
  `unpack_shifted`), the batch key of the metadata (`PACKING_KEY`) and `packed_call`.
- `attention`: the varlen attention for `sdpa`/`eager` models (one fused kernel call per layer where `kernels` chose
  one, else per segment), and the registration of trl-ext attention implementations with transformers
  (`register_attention`, `switch_attention`, `attention_users`, `unregister_attention`, `packed_or_base_attention`,
  `packed_or_base_mask`).
- `kernels`: the fused varlen kernels (`varlen_attn`, `flash_attn`), the choice of one per trainer and model
  (`choose`, `choose_for_model`, `log_choices`); `probe`: each call pattern measured on the device before it
  trains (`checked_kernel`); `segments`: the per-batch kernel metadata (`Segments`, `cached_segments`).
- `glue`: what a packing plugin needs around the model: `check_packable_trainer`, `AnnotatingCollator`,
  `scoring_call`, `positional_input_ids`, `repad_outputs`, `VISION_KEYS`.
- `positions`: the packed position of each padded position, announced around a packed call to the modules inside it
  (`PackedPositions`, `packed_positions`, `current_packed_positions`).

This package imports nothing itself; import the submodule that owns a name. The submodules import torch (and
`attention` transformers), so plugins import them from their hooks modules only, never from their declarations.
"""
