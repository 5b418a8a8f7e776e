from omni_trio import EngineConfig
from omni_trio.serve import ServiceOptions, build_service

service = build_service(
    ServiceOptions(model="./my-sd-folder", engine_config=EngineConfig(max_batch_size=8))
)
app = service.app
