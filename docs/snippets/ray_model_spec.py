from omni_trio.runners import ModelSpec
from omni_trio.serve.ray import deployment

spec = ModelSpec(
    source="tiny-flux",                         # or "org/name" from the Hugging Face
    dtype="bf16",                               # cache, or a diffusers folder
    compile="blocks",
)
app = deployment(
    spec,
    num_replicas=2,
    warm_up=True,                               # each replica compiles here,
    warm_up_sizes=[(64, 64)],                   # before a client waits on it
)
