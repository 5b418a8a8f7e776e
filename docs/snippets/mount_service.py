from contextlib import asynccontextmanager

from starlette.applications import Starlette
from starlette.routing import Mount

from omni_trio.serve import Service

service = Service(runner)

@asynccontextmanager
async def lifespan(app):
    async with service.lifespan():
        yield

app = Starlette(routes=[Mount("/images", app=service.app)], lifespan=lifespan)
# POST /images/v1/images/generations, GET /images/health, ...
