from omni_trio.runners import DiffusersRunner

runner = DiffusersRunner(pipeline, max_batch_size=8)  # pipeline: one you loaded
