from pathlib import Path

from omni_trio.serve import OutputConfig, ServeConfig, Service

outputs = OutputConfig(
    store="outputs",                            # a folder, or "s3://my-bucket/omni-trio"
    secret=Path("output.secret").read_bytes(),  # the same file on every replica
    ttl_s=3600,                                 # each URL, and its file, lives an hour
)
service = Service(runner, config=ServeConfig(model_name="my-model", outputs=outputs))
