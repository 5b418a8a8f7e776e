runner = DiffusersRunner(pipeline, decode_slices=True, tile_above=1024 * 1024, framewise_above=None)
