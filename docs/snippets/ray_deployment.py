from ray import serve
import omni_trio as ot
from omni_trio.serve.ray import deployment

app = deployment(
    "tiny-sd",                                  # or a diffusers folder, or a function
    num_replicas=2,                             # returning the runner(s)
    engine_config=ot.EngineConfig(max_batch_size=4, max_waiting=64, shutdown_grace=10),
)
handle = serve.run(app, name="images", route_prefix="/")
output = handle.generate.remote({"prompt": "a flower", "num_steps": 20}).result()
