import omni_trio as ot

runner.load_adapter("ink", "loras/ink.safetensors")     # or a state dict
runner.load_adapter("film", "loras/film.safetensors")
inked = ot.GenerationRequest(prompt="...", adapters={"ink": 0.8})
mixed = ot.GenerationRequest(prompt="...", adapters={"ink": 0.3, "film": 0.5})
plain = ot.GenerationRequest(prompt="...")               # none: the same batch
listed = runner.adapters()      # AdapterInfo: name, bytes, holders, loaded, source
runner.unload_adapter("film")
