from omni_trio import EngineConfig
from omni_trio.serve import ServeConfig, Service, create_app

app = create_app(runner, engine_config=EngineConfig(max_batch_size=8, shutdown_grace=30),
                 config=ServeConfig(model_name="my-model", default_steps=30))
service: Service = app.state.service   # drain(), is_draining, metrics, engine
