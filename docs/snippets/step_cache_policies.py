import omni_trio as ot

cached = ot.GenerationRequest(prompt="...", cache=ot.StepCache(kind="first-block", threshold=0.08))
forecast = ot.GenerationRequest(prompt="...", cache=ot.StepCache(kind="taylorseer", interval=5, order=2))
config = ot.EngineConfig(default_cache=ot.StepCache(kind="first-block"))  # for requests that give none
plain = ot.GenerationRequest(prompt="...", cache=ot.StepCache(kind="none"))  # opts out of that default
