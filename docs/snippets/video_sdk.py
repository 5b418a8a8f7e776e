import warnings
from pathlib import Path

import openai

warnings.filterwarnings("ignore", "The Sora API", DeprecationWarning)  # see below
client = openai.OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="unused")
video = client.videos.create(prompt="a boat", seconds="2", size="64x64",
                             extra_body={"num_inference_steps": 20, "seed": 1})
video = client.videos.poll(video.id, poll_interval_ms=200)   # until completed or failed
Path("boat.mp4").write_bytes(client.videos.download_content(video.id).read())
client.videos.delete(video.id)
for job in client.videos.list(limit=20):                     # newest first, paged
    print(job.id, job.status)
